-- wait: publish what one gateway holds in a pool (extproc.defer), replacing what it published
-- before; nothing held: its field goes. reserve.lua reads it: a lower level's entry from another
-- gateway yields while the pool is emptier than where these were last refused.
--
-- KEYS[1]  waiting  hash: gateway -> "lease-end level count work kv level count work kv ..."
-- ARGV[1]  the gateway
-- ARGV[2]  lease, ms (Redis's clock: past it, a gateway that died holds nothing)
-- ARGV[3..] four per level held: level, entries, work ms, KV tokens (the pool at its fullest
--           when that level's held requests were last refused)
-- Returns nothing.
if #ARGV < 3 then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local value = string.format('%.17g', now + tonumber(ARGV[2]))
for i = 3, #ARGV do
  value = value .. ' ' .. ARGV[i]
end
redis.call('HSET', KEYS[1], ARGV[1], value)
