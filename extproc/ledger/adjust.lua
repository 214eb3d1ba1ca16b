-- adjust: change the cost (and KV tokens) of a live entry (its exact cost became known after
-- it was admitted).
--
-- KEYS[1]  costs   hash: request id -> "cost kv"
-- KEYS[2]  total   string: the pool's outstanding work in ms
-- KEYS[3]  kv      string: the KV tokens the pool's entries hold
-- ARGV[1]  request id
-- ARGV[2]  new cost, ms (decimal)
-- ARGV[3]  new KV tokens (integer), or '' to keep them
-- Returns 1 when adjusted, 0 when the entry is not there (never re-creates one).
-- The total moves by (new - old), computed as in the in-process ledger: (total - old) + new.
local function split(v)  -- "cost kv" (or "cost", from before kv was kept): numbers
  local sep = string.find(v, ' ', 1, true)
  if not sep then return tonumber(v), 0 end
  return tonumber(string.sub(v, 1, sep - 1)), tonumber(string.sub(v, sep + 1))
end
local value = redis.call('HGET', KEYS[1], ARGV[1])
if not value then
  return 0
end
local old, kv = split(value)
local new_kv = kv
if ARGV[3] ~= '' then new_kv = tonumber(ARGV[3]) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. string.format('%d', new_kv))
local total = tonumber(redis.call('GET', KEYS[2]) or '0') - old + tonumber(ARGV[2])
if total < 0 then total = 0 end
redis.call('SET', KEYS[2], string.format('%.17g', total))
redis.call('INCRBY', KEYS[3], new_kv - kv)
return 1
