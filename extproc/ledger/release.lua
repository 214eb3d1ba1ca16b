-- release: remove requests' entries, each exactly once (a batch: the releases a gateway
-- queued while its previous batch was in flight, extproc/ledger/redis.py).
--
-- KEYS[1]  leases  sorted set: request id -> lease end, ms of Redis server time
-- KEYS[2]  costs   hash: request id -> "cost kv group..."
-- KEYS[3]  total   string: the pool's outstanding work in ms
-- KEYS[4]  kv      string: the KV tokens the pool's entries hold
-- KEYS[5]  groups  hash: group -> "count work" of the entries counted in it
-- ARGV[1..] request ids, released in this order (an id twice: the second finds nothing)
-- Returns {{1 or 0 per id}, the pool's snapshot after them (as snapshot.lua)}: 1 when the
-- entry was removed, 0 when it was not there (a double, late or unknown release), which
-- touches nothing. An emptied pool leaves no keys behind. Each id is released exactly as a
-- call of its own would (the total written back after each), so the totals stay bit-for-bit
-- those of the in-process ledger.
local function release(id)
  local value = redis.call('HGET', KEYS[2], id)
  if not value then
    return 0
  end
  local cost, kv, groups = split(value)
  redis.call('HDEL', KEYS[2], id)
  redis.call('ZREM', KEYS[1], id)
  uncount(KEYS[5], groups, cost)
  if redis.call('ZCARD', KEYS[1]) == 0 then
    redis.call('DEL', KEYS[3], KEYS[4], KEYS[5])
  else
    local total = tonumber(redis.call('GET', KEYS[3]) or '0') - cost
    if total < 0 then total = 0 end
    redis.call('SET', KEYS[3], string.format('%.17g', total))
    redis.call('DECRBY', KEYS[4], kv)
  end
  return 1
end
local done = {}
for i = 1, #ARGV do
  done[i] = release(ARGV[i])
end
return {done, view(KEYS[1], KEYS[3], KEYS[4], KEYS[5])}
