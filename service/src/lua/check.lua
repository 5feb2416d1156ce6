-- One check per run: KEYS one per limit (then, with overrides, one
-- override key per limit, then, with epochs, one epoch key per limit,
-- then, with a grant record, its key); ARGV nonce, overrides (0/1), test
-- clock key ('' in production), lease units wanted and share (0 and 1:
-- no lease), whether a grant record's key follows (0/1), whether epoch
-- keys follow (0: no, 1: for the receipts asked, 2: in case a lease is
-- granted), then ARGS_PER_LIMIT arguments per limit. Returns
-- the decision, then the run's clock (microseconds: with the nonce, the
-- receipt of a reservation). Follows decide.lua (see script.rs).
local ovr = tonumber(ARGV[2])
local g = tonumber(ARGV[6])
local ep = tonumber(ARGV[7])
local now_us = clock(ARGV[3])
local e = math.min(ep, 1)
local n = (#KEYS - g) / (1 + ovr + e)
local grant, epochs = nil, nil
if g == 1 then grant = #KEYS end
if e == 1 then epochs = n * (1 + ovr) end
local out = decide(0, n, 7, ARGV[1], now_us, ovr,
                   tonumber(ARGV[4]), tonumber(ARGV[5]), grant, epochs, ep == 1)
out[#out + 1] = now_us
return out
