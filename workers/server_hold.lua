-- A server's "wait until" (its Retry-After / RetryInfo), held for the whole fleet.
-- KEYS[1]  the server's hold key (token_bucket.lua refuses every request to that server before it)
-- ARGV[1]  the server's delay in microseconds, counted from now (Redis time)
-- Keeps the later of the hold already set and this one. Returns the hold's end, microseconds from now.
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local delay = tonumber(ARGV[1])
local wanted = now + delay
local held = tonumber(redis.call('GET', KEYS[1]) or '0')
if held >= wanted then
  return held - now
end
redis.call('SET', KEYS[1], wanted, 'PX', math.ceil(delay / 1000) + 1000)
return delay
