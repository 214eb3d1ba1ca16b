-- wait: publish the highest priority one gateway holds requests of in a pool (extproc.decision.defer),
-- replacing what it published before; none held: its field goes. reserve.lua reads it: an
-- entry of a lower priority from another gateway yields while the lease lasts.
--
-- KEYS[1]  waiting  hash: gateway -> "lease-end level"
-- ARGV[1]  the gateway
-- ARGV[2]  lease, ms (Redis's clock: past it, a gateway that died holds nothing)
-- ARGV[3]  the highest priority level it holds, or '' for none
-- Returns nothing.
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.17g', now + tonumber(ARGV[2])) .. ' '
           .. ARGV[3])
