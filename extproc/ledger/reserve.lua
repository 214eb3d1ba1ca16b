-- reserve: record an admitted request unless it would push its pool past the ceiling (work) or
-- past its count (entries), in one atomic step, so two gateways can never both take the last
-- room or the last slot.
--
-- KEYS[1]  leases  sorted set: request id -> lease end, ms of Redis server time
-- KEYS[2]  costs   hash: request id -> "cost kv group..." (cost in ms as the gateway sent it,
--                  KV tokens, the groups it counts in)
-- KEYS[3]  total   string: the pool's outstanding work in ms (sum of costs), kept by these scripts
-- KEYS[4]  kv      string: the KV tokens the pool's entries hold (sum of kv), kept likewise
-- KEYS[5]  groups  hash: group -> "count work" of the entries counted in it
-- KEYS[6]  waiting hash: gateway -> "lease-end level": the highest priority it holds (wait.lua)
-- ARGV[1]  request id
-- ARGV[2]  cost, ms (decimal)
-- ARGV[3]  lease, ms
-- ARGV[4]  ceiling, ms (decimal), or '' for no check
-- ARGV[5]  KV tokens (integer)
-- ARGV[6]  the most entries the pool may hold with this one (integer), or '' for no check
-- ARGV[7]  the groups it counts in, space-separated (names hold no space), or ''
-- ARGV[8]  its priority level, or '' for no yield check (an entry recorded without a ceiling)
-- ARGV[9]  the gateway recording it (its own held requests never make it yield)
-- ARGV[10..] caps, three arguments each: group, most entries ('' none), most work ms ('' none)
-- Returns {1 when recorded or already present (a retried reserve counts once), 0 when refused
--          (ceiling, count or cap), 2 when it yields: another gateway, its lease live, holds
--          requests of a higher priority;
--          the pool's snapshot after it (as snapshot.lua)}: the next decision's input, without
--          a snapshot call of its own (extproc.gateway.gate).
--
-- Arithmetic is IEEE double, as in the in-process ledger, and the total is stored with 17
-- significant digits, so both ledgers compute bit-for-bit the same outstanding work.
-- Leases use TIME (Redis's clock), never the caller's.
local function answer(ok)
  return {ok, view(KEYS[1], KEYS[3], KEYS[4], KEYS[5])}
end
local id = ARGV[1]
if redis.call('ZSCORE', KEYS[1], id) then
  return answer(1)
end
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local cost = tonumber(ARGV[2])
if ARGV[4] ~= '' and total + cost > tonumber(ARGV[4]) then
  return answer(0)
end
if ARGV[6] ~= '' and redis.call('ZCARD', KEYS[1]) + 1 > tonumber(ARGV[6]) then
  return answer(0)
end
local counts = {}  -- group -> {count, work} as they stand
local function group(g)
  if counts[g] == nil then
    local v = redis.call('HGET', KEYS[5], g)
    if v then
      local n, work = counted(v)
      counts[g] = {n, work}
    else
      counts[g] = {0, 0}
    end
  end
  return counts[g]
end
for i = 10, #ARGV, 3 do
  local c = group(ARGV[i])
  if ARGV[i + 1] ~= '' and c[1] + 1 > tonumber(ARGV[i + 1]) then
    return answer(0)
  end
  if ARGV[i + 2] ~= '' and c[2] + cost > tonumber(ARGV[i + 2]) then
    return answer(0)
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
if ARGV[8] ~= '' then
  local held = redis.call('HGETALL', KEYS[6])
  for i = 1, #held, 2 do
    local lease_end, level = counted(held[i + 1])  -- "lease-end level"
    if held[i] ~= ARGV[9] and lease_end > now and level > tonumber(ARGV[8]) then
      return answer(2)
    end
  end
end
redis.call('ZADD', KEYS[1], string.format('%.17g', now + tonumber(ARGV[3])), id)
local value = ARGV[2] .. ' ' .. ARGV[5]
for g in string.gmatch(ARGV[7], '%S+') do
  value = value .. ' ' .. g
  local c = group(g)
  local work = c[2] + cost
  if work < 0 then work = 0 end
  redis.call('HSET', KEYS[5], g, string.format('%d %.17g', c[1] + 1, work))
end
redis.call('HSET', KEYS[2], id, value)
redis.call('SET', KEYS[3], string.format('%.17g', total + cost))
redis.call('INCRBY', KEYS[4], ARGV[5])
return answer(1)
