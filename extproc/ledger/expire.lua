-- expire: drop at most ARGV[1] entries whose lease has ended (their gateway died or lost the
-- stream), oldest first. Bounded, so one call never stalls Redis however large the backlog;
-- the caller repeats while a full batch came back.
--
-- KEYS[1]  leases  sorted set: request id -> lease end, ms of Redis server time
-- KEYS[2]  costs   hash: request id -> "cost kv group..."
-- KEYS[3]  total   string: the pool's outstanding work in ms
-- KEYS[4]  kv      string: the KV tokens the pool's entries hold
-- KEYS[5]  groups  hash: group -> "count work" of the entries counted in it
-- KEYS[6]  waiting hash: gateway -> "lease-end level" (wait.lua); lapsed gateways go too
-- ARGV[1]  most entries to drop
-- Returns the number of entries dropped.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local held = redis.call('HGETALL', KEYS[6])
for i = 1, #held, 2 do
  local lease_end = counted(held[i + 1])
  if lease_end <= now then
    redis.call('HDEL', KEYS[6], held[i])
  end
end
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.17g', now),
                       'LIMIT', 0, tonumber(ARGV[1]))
if #ids == 0 then
  return 0
end
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local kvs = 0
for _, id in ipairs(ids) do
  local cost, kv, groups = split(redis.call('HGET', KEYS[2], id) or '0')
  redis.call('HDEL', KEYS[2], id)
  uncount(KEYS[5], groups, cost)
  redis.call('ZREM', KEYS[1], id)
  total = total - cost
  if total < 0 then total = 0 end
  kvs = kvs + kv
end
if redis.call('ZCARD', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[3], KEYS[4], KEYS[5])
else
  redis.call('SET', KEYS[3], string.format('%.17g', total))
  redis.call('DECRBY', KEYS[4], kvs)
end
return #ids
