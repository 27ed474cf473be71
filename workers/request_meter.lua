-- One charged request counted in its second, and the highest per-second count of its hour raised.
-- KEYS[1]  the second's counter (rate:{server}:{bucket}:{second})
-- KEYS[2]  the hour's highest per-second count (ratemax:{server}:{bucket}:{hour})
-- ARGV[1]  seconds the second's counter is kept
-- ARGV[2]  seconds the hour's highest count is kept
-- Returns the second's count after this request.
local n = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
local highest = tonumber(redis.call('GET', KEYS[2]) or '0')
if n > highest then
  redis.call('SET', KEYS[2], n, 'EX', tonumber(ARGV[2]))
end
return n
