-- A rate limit per (server, budget) that holds across every worker process: GCRA with reservations.
-- KEYS[1]  the bucket key
-- KEYS[2]  the server's hold (server_hold.lua): until then the server asked for no request at all
-- ARGV[1]  emission interval in microseconds (1e6 / rate)
-- ARGV[2]  burst tolerance in microseconds (how far ahead of its schedule a call may go)
-- ARGV[3]  reservation horizon in microseconds (how far ahead a caller may book a slot and wait for it)
-- ARGV[4]  the longest hold kept, in microseconds from now (workers.hot.MAX_SERVER_WAIT_S): a hold set
--          longer (by a worker without that cap, during a rolling deploy) is cut to it here too
-- KEYS[3], KEYS[4], ARGV[5], ARGV[6], optional: request_meter.lua's keys and expiries for the request this
--          token pays for. A token granted for now counts the request there too (the caller sends it at
--          once), so a charge is one round trip; a slot booked ahead counts nothing (the caller meters the
--          request when it sends it, in that second). Without them the script is what it was.
-- Returns {1, delay_us}: granted; make the call after delay_us (0 = now). {0, wait_us}: refused; the next
-- slot within reach is wait_us away, so ask again then. {1, 0, count}: granted for now and counted, the
-- request's second now at count.
-- Redis TIME is the one clock, so worker clocks never matter (the meter's second is the worker's: its keys
-- come named).
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local interval = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local horizon = tonumber(ARGV[3])
-- One read of both keys (the hold, then the bucket's theoretical arrival time).
local read = redis.call('MGET', KEYS[2], KEYS[1])
local hold = tonumber(read[1] or '0')
local longest = tonumber(ARGV[4])
if hold > now + longest then
  hold = now + longest
  redis.call('SET', KEYS[2], hold, 'PX', math.ceil(longest / 1000) + 1000)
end
if hold > now then
  return {0, hold - now}
end
local tat = tonumber(read[2] or '0')
if tat < now then
  tat = now
end
local ahead = tat - now - tolerance
if ahead > horizon then
  return {0, ahead - horizon}
end
redis.call('SET', KEYS[1], tat + interval, 'PX', math.ceil((tat + interval - now) / 1000) + 1000)
if ahead < 0 then
  ahead = 0
end
if ahead > 0 or #KEYS < 4 then
  return {1, ahead}
end
-- request_meter.lua, step for step. A metric is never worth a request: its failure leaves the grant as is.
local counted, n = pcall(function()
  local count = redis.call('INCR', KEYS[3])
  if count == 1 then
    redis.call('EXPIRE', KEYS[3], tonumber(ARGV[5]))
    redis.call('SET', KEYS[4], 1, 'NX', 'EX', tonumber(ARGV[6]))
    return count
  end
  local highest = tonumber(redis.call('GET', KEYS[4]) or '0')
  if count > highest then
    redis.call('SET', KEYS[4], count, 'EX', tonumber(ARGV[6]))
  end
  return count
end)
if not counted then
  return {1, 0}
end
return {1, 0, n}
