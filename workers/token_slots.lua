-- A rate limit per (server, budget) that holds across every worker process: GCRA with reservations. Each
-- call books slots on one server's bucket, each no earlier than its caller asks: one token for a request
-- (workers/hot.py HotState.take: one slot asked for now), or the polls of one longcall.poll message, each due
-- at its own time within the dispatch tick, booking their requests in one call. Slot i is the slot a caller
-- asking at now + offset_i would get alone, given the slots booked before it in this call: so the bucket's
-- bound (at most rate requests in any one-second window, calls made at their slots) holds for every slot,
-- and no request goes before its due time. A slot booked ahead is a promise to wait for it.
-- KEYS[1]  the bucket key
-- KEYS[2]  the server's hold (server_hold.lua): until then the server asked for no request at all
-- KEYS[3..8], optional: the request meter's keys (workers/budget.py rate_key and peak_key) of the worker's
--          seconds s, s + 1 and s + 2, in the order rate s, peak s, rate s+1, peak s+1, rate s+2, peak s+2.
--          Each slot granted counts its request in the second it will leave on the worker's clock (the
--          worker is ARGV[8] microseconds into second s when it calls), so a batch's requests are counted
--          here, in the call that books them, not one call each when sent. A slot past second s + 2 is not
--          counted (the slots are in time order: those counted come first): its caller counts it when sent.
-- ARGV[1]  emission interval in microseconds (1e6 / rate)
-- ARGV[2]  burst tolerance in microseconds (how far ahead of its schedule a call may go)
-- ARGV[3]  reservation horizon in microseconds: the longest a call may wait past the time it asked for
-- ARGV[4]  the longest hold kept, in microseconds from now (workers.hot.MAX_SERVER_WAIT_S)
-- ARGV[5]  the counter's expiry (s), ARGV[6] the highest count's expiry (s), ARGV[7] unused (0)
-- ARGV[8]  the worker's microseconds into its second s (meter only)
-- ARGV[9..] the slots asked for: each one's offset from now in microseconds, in ascending order
-- Returns {granted, wait_us, counted, delay_1_us, ..., delay_granted_us}: the first `granted` slots asked
-- for are booked, slot i for now + delay_i; the others (past the horizon, or all of them under a hold) are
-- not: wait_us is how soon the first of them comes within reach. counted: how many were counted (the first
-- ones). A single token (workers/hot.py HotState.take) is this script with one slot asked for now.
-- Redis TIME is the one clock of the bucket; in a Redis Cluster every key carries the server's hash tag.
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local interval = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local horizon = tonumber(ARGV[3])
local wanted = #ARGV - 8
local read = redis.call('MGET', KEYS[2], KEYS[1])
local hold = tonumber(read[1] or '0')
local longest = tonumber(ARGV[4])
if hold > now + longest then
  hold = now + longest
  redis.call('SET', KEYS[2], hold, 'PX', math.ceil(longest / 1000) + 1000)
end
if hold > now then
  return {0, hold - now, 0}
end
local stored = tonumber(read[2] or '0')
local answer = {0, 0, 0}
local per_second = {0, 0, 0}
local granted = 0
local countable = 0
for i = 1, wanted do
  local asked = now + math.max(0, tonumber(ARGV[8 + i]))
  local tat = math.max(stored, asked)
  local slot = math.max(asked, tat - tolerance)
  if slot - asked > horizon then
    answer[2] = slot - asked - horizon
    break
  end
  stored = tat + interval
  granted = granted + 1
  answer[3 + granted] = slot - now
  local second = math.floor((tonumber(ARGV[8]) + slot - now) / 1000000) + 1
  if second <= 3 then
    per_second[second] = per_second[second] + 1
    countable = countable + 1
  end
end
answer[1] = granted
if granted == 0 then
  return answer
end
redis.call('SET', KEYS[1], stored, 'PX', math.ceil((stored - now) / 1000) + 1000)
if #KEYS < 8 then
  return answer
end
-- request_meter.lua's steps, one second at a time. A metric is never worth a request: its failure leaves
-- the slots as booked.
local counted = pcall(function()
  for s = 1, 3 do
    local n = per_second[s]
    if n > 0 then
      local rate_key, peak_key = KEYS[1 + 2 * s], KEYS[2 + 2 * s]
      local count = redis.call('INCRBY', rate_key, n)
      if count == n then
        redis.call('EXPIRE', rate_key, tonumber(ARGV[5]))
      end
      local highest = tonumber(redis.call('GET', peak_key) or '0')
      if count > highest then
        redis.call('SET', peak_key, count, 'EX', tonumber(ARGV[6]))
      end
    end
  end
end)
if counted then
  answer[3] = countable
end
return answer
