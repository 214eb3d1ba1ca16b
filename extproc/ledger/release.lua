-- release: remove one request's entry, exactly once.
--
-- KEYS[1]  leases  sorted set: request id -> lease end, ms of Redis server time
-- KEYS[2]  costs   hash: request id -> cost in ms
-- KEYS[3]  total   string: the pool's outstanding work in ms
-- ARGV[1]  request id
-- Returns 1 when the entry was removed, 0 when it was not there (a double, late or unknown
-- release), which touches nothing. An emptied pool leaves no keys behind.
local cost = redis.call('HGET', KEYS[2], ARGV[1])
if not cost then
  return 0
end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('ZCARD', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[3])
else
  local total = tonumber(redis.call('GET', KEYS[3]) or '0') - tonumber(cost)
  if total < 0 then total = 0 end
  redis.call('SET', KEYS[3], string.format('%.17g', total))
end
return 1
