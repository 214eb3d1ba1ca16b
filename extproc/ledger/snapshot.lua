-- snapshot: the pool's in-flight count and outstanding work, read together (consistent).
--
-- KEYS[1]  leases  sorted set: request id -> lease end, ms of Redis server time
-- KEYS[2]  total   string: the pool's outstanding work in ms
-- Returns {count, total as a decimal string} (a string: Lua numbers would be truncated).
return {redis.call('ZCARD', KEYS[1]), redis.call('GET', KEYS[2]) or '0'}
