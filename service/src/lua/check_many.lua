-- Several checks per run, decided one after the other, each all or
-- nothing on its own; one TIME for all. ARGV: nonce, number of checks, then
-- per check its number of limits and their arguments. Follows decide.lua.
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local out, k, a = {}, 0, 2
for c = 1, tonumber(ARGV[2]) do
  local n = tonumber(ARGV[a + 1])
  local r = decide(k, n, a + 1, ARGV[1] .. '.' .. c, now_us)
  for j = 1, #r do out[#out + 1] = r[j] end
  k = k + n
  a = a + 1 + ARGS_PER_LIMIT * n
end
return out
