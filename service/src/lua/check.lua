-- One check per run: KEYS one per limit (then, with overrides, one
-- override key per limit, then, with a grant record, its key); ARGV nonce,
-- overrides (0/1), test clock key ('' in production), lease units wanted
-- and share (0 and 1: no lease), whether a grant record's key follows
-- (0/1), then ARGS_PER_LIMIT arguments per limit. Returns the decision,
-- then the run's clock (microseconds: with the nonce, the receipt of a
-- reservation). Follows decide.lua (see script.rs).
local ovr = tonumber(ARGV[2])
local g = tonumber(ARGV[6])
local now_us = clock(ARGV[3])
local grant = nil
if g == 1 then grant = #KEYS end
local out = decide(0, (#KEYS - g) / (1 + ovr), 6, ARGV[1], now_us, ovr,
                   tonumber(ARGV[4]), tonumber(ARGV[5]), grant)
out[#out + 1] = now_us
return out
