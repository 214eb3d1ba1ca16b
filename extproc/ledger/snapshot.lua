-- snapshot: the pool's in-flight count, outstanding work and KV tokens, read together
-- (consistent).
--
-- KEYS[1]  leases  sorted set: request id -> lease end, ms of Redis server time
-- KEYS[2]  total   string: the pool's outstanding work in ms
-- KEYS[3]  kv      string: the KV tokens the pool's entries hold
-- KEYS[4]  groups  hash: group -> "count work"
-- Returns {count, total as a decimal string (Lua numbers would be truncated), kv,
--          {group, "count work", ...}}.
return {redis.call('ZCARD', KEYS[1]), redis.call('GET', KEYS[2]) or '0',
        tonumber(redis.call('GET', KEYS[3]) or '0'), redis.call('HGETALL', KEYS[4])}
