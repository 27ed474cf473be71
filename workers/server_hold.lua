-- A server's "wait until" (its Retry-After / RetryInfo), held for the whole fleet.
-- KEYS[1]  the server's hold key (token_slots.lua refuses every request to that server before it)
-- ARGV[1]  the server's delay in microseconds, counted from now (Redis time)
-- ARGV[2]  the longest hold kept, in microseconds from now (workers.hot.MAX_SERVER_WAIT_S)
-- Keeps the later of the hold already set and this one, neither past now + ARGV[2] (a hold set longer,
-- by a worker without that cap, is cut to it). Returns the hold's end, microseconds from now.
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local longest = tonumber(ARGV[2])
local delay = math.min(tonumber(ARGV[1]), longest)
local wanted = now + delay
local held = tonumber(redis.call('GET', KEYS[1]) or '0')
if held > now + longest then
  held = 0
end
if held >= wanted then
  return held - now
end
redis.call('SET', KEYS[1], wanted, 'PX', math.ceil(delay / 1000) + 1000)
return delay
