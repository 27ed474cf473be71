-- How long a server's hold has left (server_hold.lua sets it), read on the node that keeps it: its clock
-- is the one the hold was set by (in a Redis Cluster, another node's TIME is another clock).
-- KEYS[1]  the server's hold key
-- ARGV[1]  the longest hold kept, in microseconds from now (workers.hot.MAX_SERVER_WAIT_S): a longer one
--          (set by a worker without that cap) is reported cut to it, as token_slots.lua cuts it
-- Returns {left_us}: 0 when there is none.
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local left = tonumber(redis.call('GET', KEYS[1]) or '0') - now
if left < 0 then
  left = 0
end
return {math.min(left, tonumber(ARGV[1]))}
