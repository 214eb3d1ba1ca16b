-- release: remove one request's entry, exactly once.
--
-- KEYS[1]  leases  sorted set: request id -> lease end, ms of Redis server time
-- KEYS[2]  costs   hash: request id -> "cost kv group..."
-- KEYS[3]  total   string: the pool's outstanding work in ms
-- KEYS[4]  kv      string: the KV tokens the pool's entries hold
-- KEYS[5]  groups  hash: group -> "count work" of the entries counted in it
-- ARGV[1]  request id
-- Returns 1 when the entry was removed, 0 when it was not there (a double, late or unknown
-- release), which touches nothing. An emptied pool leaves no keys behind.
local function split(v)  -- "cost kv group..." (kv and groups may be absent): cost, kv, groups
  local parts = {}
  for w in string.gmatch(v, '%S+') do parts[#parts + 1] = w end
  local groups = {}
  for i = 3, #parts do groups[#groups + 1] = parts[i] end
  return tonumber(parts[1]), tonumber(parts[2] or '0'), groups
end
local function uncount(key, groups, cost)  -- one entry of cost leaves its groups
  for _, g in ipairs(groups) do
    local v = redis.call('HGET', key, g)
    if v then
      local sep = string.find(v, ' ', 1, true)
      local n = tonumber(string.sub(v, 1, sep - 1)) - 1
      if n <= 0 then
        redis.call('HDEL', key, g)
      else
        local work = tonumber(string.sub(v, sep + 1)) - cost
        if work < 0 then work = 0 end
        redis.call('HSET', key, g, string.format('%d %.17g', n, work))
      end
    end
  end
end
local value = redis.call('HGET', KEYS[2], ARGV[1])
if not value then
  return 0
end
local cost, kv, groups = split(value)
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
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
