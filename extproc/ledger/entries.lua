-- entries: the helpers every script is sent with (extproc/ledger/redis.py puts this file in
-- front of each script; Redis runs each script alone, so they cannot share code otherwise).
--
-- An entry's value in the costs hash is "cost kv group..." (kv and groups may be absent, as
-- before they were kept); a group's value in the groups hash is "count work".
local function split(v)  -- an entry's value: cost, kv, {group, ...}
  local parts = {}
  for w in string.gmatch(v, '%S+') do parts[#parts + 1] = w end
  local groups = {}
  for i = 3, #parts do groups[#groups + 1] = parts[i] end
  return tonumber(parts[1]), tonumber(parts[2] or '0'), groups
end
local function counted(v)  -- two numbers: a group's "count work", a gateway's "lease-end level"
  local sep = string.find(v, ' ', 1, true)
  return tonumber(string.sub(v, 1, sep - 1)), tonumber(string.sub(v, sep + 1))
end
local function uncount(key, groups, cost)  -- one entry of cost leaves its groups
  for _, g in ipairs(groups) do
    local v = redis.call('HGET', key, g)
    if v then
      local n, work = counted(v)
      if n <= 1 then
        redis.call('HDEL', key, g)
      else
        work = work - cost
        if work < 0 then work = 0 end
        redis.call('HSET', key, g, string.format('%d %.17g', n - 1, work))
      end
    end
  end
end
local function view(leases, total, kv, groups)  -- the pool as snapshot.lua reads it
  return {redis.call('ZCARD', leases), redis.call('GET', total) or '0',
          tonumber(redis.call('GET', kv) or '0'), redis.call('HGETALL', groups)}
end
