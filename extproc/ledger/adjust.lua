-- adjust: change the cost of a live entry (its exact cost became known after it was admitted).
--
-- KEYS[1]  costs   hash: request id -> cost in ms
-- KEYS[2]  total   string: the pool's outstanding work in ms
-- ARGV[1]  request id
-- ARGV[2]  new cost, ms (decimal)
-- Returns 1 when adjusted, 0 when the entry is not there (never re-creates one).
-- The total moves by (new - old), computed as in the in-process ledger: (total - old) + new.
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local total = tonumber(redis.call('GET', KEYS[2]) or '0') - tonumber(old) + tonumber(ARGV[2])
if total < 0 then total = 0 end
redis.call('SET', KEYS[2], string.format('%.17g', total))
return 1
