-- Several checks per run, decided one after the other, each all or
-- nothing on its own; one clock for all. ARGV: nonce, overrides (0/1),
-- test clock key, number of checks, then per check its number of limits,
-- the lease units it wants and their share (0 and 1: no lease), and its
-- limits' arguments. Returns every check's reply, then the run's clock
-- (microseconds: with the nonce, the receipt of a reservation). Follows
-- decide.lua.
local ovr = tonumber(ARGV[2])
local now_us = clock(ARGV[3])
local out, k, a = {}, 0, 4
for c = 1, tonumber(ARGV[4]) do
  local n = tonumber(ARGV[a + 1])
  local r = decide(k, n, a + 3, ARGV[1] .. '.' .. c, now_us, ovr,
                   tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]))
  for j = 1, #r do out[#out + 1] = r[j] end
  k = k + n * (1 + ovr)
  a = a + 3 + ARGS_PER_LIMIT * n
end
out[#out + 1] = now_us
return out
