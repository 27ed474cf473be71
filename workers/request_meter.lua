-- One charged request counted in its second, and the highest per-second count of its hour raised.
-- KEYS[1]  the second's counter (rate:{server}:{bucket}:{second})
-- KEYS[2]  the hour's highest per-second count (ratemax:{server}:{bucket}:{hour})
-- ARGV[1]  seconds the second's counter is kept
-- ARGV[2]  seconds the hour's highest count is kept
-- Returns the second's count after this request.
-- The first request of its second creates the counter (INCR), which is then given its expiry, and is a
-- count of 1: the hour's highest is at least that, set only if the hour has none yet. A later one reads it.
-- token_slots.lua takes the same steps for the slots it books, each in its second (its KEYS[3..8], with
-- INCRBY): keep them alike.
local n = redis.call('INCR', KEYS[1])
if n == 1 then
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
  redis.call('SET', KEYS[2], 1, 'NX', 'EX', tonumber(ARGV[2]))
  return n
end
local highest = tonumber(redis.call('GET', KEYS[2]) or '0')
if n > highest then
  redis.call('SET', KEYS[2], n, 'EX', tonumber(ARGV[2]))
end
return n
