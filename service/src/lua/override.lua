-- Live overrides (meshlimitd's admin API). KEYS[1]: the override's key,
-- in the slot of the subject's counters. ARGV[1]: 'get', 'set' or 'del';
-- for 'set', ARGV[2] requests and ARGV[3] the expiry in Unix milliseconds
-- ('' for none). Returns requests and expiry (-1: none), or nothing;
-- 'del' returns the number of keys removed.
local key, op = KEYS[1], ARGV[1]
if op == 'set' then
  if ARGV[3] ~= '' then redis.call('SET', key, ARGV[2], 'PXAT', ARGV[3])
  else redis.call('SET', key, ARGV[2]) end
elseif op == 'del' then
  return { redis.call('DEL', key) }
end
local v = redis.call('GET', key)
if not v then return {} end
return { tonumber(v), redis.call('PEXPIRETIME', key) }
