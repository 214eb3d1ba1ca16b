-- adjust: change the cost (and KV tokens) of a live entry (its exact cost became known after
-- it was admitted).
--
-- KEYS[1]  costs   hash: request id -> "cost kv group..."
-- KEYS[2]  total   string: the pool's outstanding work in ms
-- KEYS[3]  kv      string: the KV tokens the pool's entries hold
-- KEYS[4]  groups  hash: group -> "count work" of the entries counted in it
-- ARGV[1]  request id
-- ARGV[2]  new cost, ms (decimal)
-- ARGV[3]  new KV tokens (integer), or '' to keep them
-- Returns 1 when adjusted, 0 when the entry is not there (never re-creates one).
-- The total moves by (new - old), computed as in the in-process ledger: (total - old) + new;
-- so does the work of each of the entry's groups.
local value = redis.call('HGET', KEYS[1], ARGV[1])
if not value then
  return 0
end
local old, kv, groups = split(value)
local new_kv = kv
if ARGV[3] ~= '' then new_kv = tonumber(ARGV[3]) end
local tail = ''
if #groups > 0 then tail = ' ' .. table.concat(groups, ' ') end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. string.format('%d', new_kv) .. tail)
for _, g in ipairs(groups) do
  local v = redis.call('HGET', KEYS[4], g)
  if v then
    local n, work = counted(v)
    work = work - old + tonumber(ARGV[2])
    if work < 0 then work = 0 end
    redis.call('HSET', KEYS[4], g, string.format('%d %.17g', n, work))
  end
end
local total = tonumber(redis.call('GET', KEYS[2]) or '0') - old + tonumber(ARGV[2])
if total < 0 then total = 0 end
redis.call('SET', KEYS[2], string.format('%.17g', total))
redis.call('INCRBY', KEYS[3], new_kv - kv)
return 1
