-- A rate limit per (server, budget) that holds across every worker process: GCRA with reservations.
-- KEYS[1]  the bucket key
-- KEYS[2]  the server's hold (server_hold.lua): until then the server asked for no request at all
-- ARGV[1]  emission interval in microseconds (1e6 / rate)
-- ARGV[2]  burst tolerance in microseconds (how far ahead of its schedule a call may go)
-- ARGV[3]  reservation horizon in microseconds (how far ahead a caller may book a slot and wait for it)
-- ARGV[4]  the longest hold kept, in microseconds from now (workers.hot.MAX_SERVER_WAIT_S): a hold set
--          longer (by a worker without that cap, during a rolling deploy) is cut to it here too
-- ARGV[5]  how many slots to book (k >= 1): the slots k callers asking now would get one by one, spaced by
--          the interval, each within the horizon; as many of them as the horizon reaches are granted
-- KEYS[3], KEYS[4], ARGV[6], ARGV[7], optional: request_meter.lua's keys and expiries for the requests these
--          slots pay for. The slots granted for now count their requests there too (the caller sends them
--          at once), so a charge is one round trip; a slot booked ahead counts nothing (the caller meters
--          its request when it sends it, in that second). Without them nothing is counted.
-- Returns {granted, first_us, wait_us, counted}: granted slots (0 under a hold or when the first slot is
-- past the horizon); slot i (from 0) is for now + max(0, first_us + i * interval); wait_us, when fewer than
-- k were granted, is how soon the next slot comes within reach (ask again then), else 0; counted is how many
-- requests the meter counted (the first ones granted for now).
-- Redis TIME is the one clock, so worker clocks never matter (the meter's second is the worker's: its keys
-- come named). In a Redis Cluster all four keys carry the server's hash tag: one slot, one node.
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local interval = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local horizon = tonumber(ARGV[3])
local wanted = tonumber(ARGV[5])
-- One read of both keys (the hold, then the bucket's theoretical arrival time).
local read = redis.call('MGET', KEYS[2], KEYS[1])
local hold = tonumber(read[1] or '0')
local longest = tonumber(ARGV[4])
if hold > now + longest then
  hold = now + longest
  redis.call('SET', KEYS[2], hold, 'PX', math.ceil(longest / 1000) + 1000)
end
if hold > now then
  return {0, 0, hold - now, 0}
end
local tat = tonumber(read[2] or '0')
if tat < now then
  tat = now
end
-- The first slot's distance past its burst allowance (negative: that far within it).
local ahead = tat - now - tolerance
if ahead > horizon then
  return {0, 0, ahead - horizon, 0}
end
local granted = math.min(wanted, math.floor((horizon - ahead) / interval) + 1)
local last = tat + granted * interval
redis.call('SET', KEYS[1], last, 'PX', math.ceil((last - now) / 1000) + 1000)
local wait = 0
if granted < wanted then
  wait = ahead + granted * interval - horizon
end
if ahead > 0 or #KEYS < 4 then
  return {granted, ahead, wait, 0}
end
local for_now = math.min(granted, math.floor(-ahead / interval) + 1)
-- request_meter.lua's steps, for for_now requests at once. A metric is never worth a request: its failure
-- leaves the grant as is.
local counted = pcall(function()
  local count = redis.call('INCRBY', KEYS[3], for_now)
  if count == for_now then
    redis.call('EXPIRE', KEYS[3], tonumber(ARGV[6]))
  end
  local highest = tonumber(redis.call('GET', KEYS[4]) or '0')
  if count > highest then
    redis.call('SET', KEYS[4], count, 'EX', tonumber(ARGV[7]))
  end
  return count
end)
if not counted then
  return {granted, ahead, wait, 0}
end
return {granted, ahead, wait, for_now}
