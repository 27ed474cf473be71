-- Compare-and-set of an operation's cancel generation (the hot copy; the ledger is authoritative).
-- KEYS[1]  the generation key
-- ARGV[1]  the generation the caller read from the ledger (expected)
-- ARGV[2]  seconds to keep the key
-- A missing key (Redis restarted or evicted it) is re-seeded from the caller's ledger value.
-- Returns {1, new_generation} when the caller won, {0, current_generation} when someone else did.
local current = redis.call('GET', KEYS[1])
if not current then
  current = ARGV[1]
end
if tonumber(current) ~= tonumber(ARGV[1]) then
  return {0, tonumber(current)}
end
local nxt = tonumber(current) + 1
redis.call('SET', KEYS[1], nxt, 'EX', tonumber(ARGV[2]))
return {1, nxt}
