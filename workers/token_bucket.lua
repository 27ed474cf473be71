-- A rate limit per (server, budget) that holds across every worker process: GCRA.
-- KEYS[1]  the bucket key
-- ARGV[1]  emission interval in microseconds (1e6 / rate)
-- ARGV[2]  burst tolerance in microseconds (how far ahead of its schedule a call may be)
-- Returns {granted (1|0), wait_us}: when refused, how long until a token is due.
-- Redis TIME is the one clock, so worker clocks never matter.
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local interval = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then
  tat = now
end
if tat - now > tolerance then
  return {0, tat - now - tolerance}
end
redis.call('SET', KEYS[1], tat + interval, 'PX', math.ceil((tat + interval - now) / 1000) + 1000)
return {1, 0}
