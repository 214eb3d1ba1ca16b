-- renew: extend the lease of a live entry to now + lease (Redis server time).
--
-- KEYS[1]  leases  sorted set: request id -> lease end, ms of Redis server time
-- ARGV[1]  request id
-- ARGV[2]  lease, ms
-- Returns 1 when renewed, 0 when the entry is not there (never re-creates one).
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
redis.call('ZADD', KEYS[1], 'XX', string.format('%.17g', now + tonumber(ARGV[2])), ARGV[1])
return 1
