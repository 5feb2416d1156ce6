-- Several checks per run, decided one after the other, each all or
-- nothing on its own; one clock for all. ARGV: nonce, overrides (0/1),
-- test clock key, number of checks, then per check its number of limits,
-- the lease units it wants and their share (0 and 1: no lease), whether
-- a grant record's key follows its keys (0/1), whether epoch keys do
-- (one per limit, after the override keys; 0: no, 1: for the receipts
-- asked, 2: in case a lease is granted), and its limits' arguments. Returns every check's reply, then the run's clock
-- (microseconds: with the nonce, the receipt of a reservation). Follows
-- decide.lua.
local ovr = tonumber(ARGV[2])
local now_us = clock(ARGV[3])
local out, k, a = {}, 0, 4
for c = 1, tonumber(ARGV[4]) do
  local n = tonumber(ARGV[a + 1])
  local g = tonumber(ARGV[a + 4])
  local ep = tonumber(ARGV[a + 5])
  local e = math.min(ep, 1)
  local grant, epochs = nil, nil
  if e == 1 then epochs = k + n * (1 + ovr) end
  if g == 1 then grant = k + n * (1 + ovr + e) + 1 end
  local r = decide(k, n, a + 5, ARGV[1] .. '.' .. c, now_us, ovr,
                   tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), grant, epochs, ep == 1)
  for j = 1, #r do out[#out + 1] = r[j] end
  k = k + n * (1 + ovr + e) + g
  a = a + 5 + ARGS_PER_LIMIT * n
end
out[#out + 1] = now_us
return out
