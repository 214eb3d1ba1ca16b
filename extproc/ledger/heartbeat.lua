-- heartbeat: extend the leases of a replica's live entries to now + lease (Redis server time),
-- all in one call; the replica sends it every third of the lease while it lives, so a dead
-- replica's entries lapse within one lease of its death.
--
-- KEYS[1]  leases  sorted set: request id -> lease end, ms of Redis server time
-- ARGV[1]  lease, ms
-- ARGV[2..] request ids
-- Returns the ids that are not there (never re-creates one: the caller decides).
local t = redis.call('TIME')
local ends = string.format('%.17g', tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
                           + tonumber(ARGV[1]))
local missing = {}
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', ends, ARGV[i])
  else
    missing[#missing + 1] = ARGV[i]
  end
end
return missing
