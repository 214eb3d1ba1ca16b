-- snapshot: the pool's in-flight count, outstanding work and KV tokens, read together
-- (consistent). ``reserve`` and ``release`` send the same view back with their answers.
--
-- KEYS[1]  leases  sorted set: request id -> lease end, ms of Redis server time
-- KEYS[2]  total   string: the pool's outstanding work in ms
-- KEYS[3]  kv      string: the KV tokens the pool's entries hold
-- KEYS[4]  groups  hash: group -> "count work"
-- Returns {count, total as a decimal string (Lua numbers would be truncated), kv,
--          {group, "count work", ...}}.
return view(KEYS[1], KEYS[2], KEYS[3], KEYS[4])
