-- One check per run: KEYS one per limit (then, with overrides, one
-- override key per limit, then, with a grant record, its key); ARGV nonce,
-- overrides (0/1), test clock key ('' in production), lease units wanted
-- and share (0 and 1: no lease), what the check's receipts need (0:
-- none, 1: a grant record's key follows, 2: receipts without one), then
-- ARGS_PER_LIMIT arguments per limit. Returns the decision, then the
-- run's clock (microseconds: with the nonce, the receipt of a
-- reservation) and the node's epoch (0 when no receipt needs it). Follows
-- decide.lua (see script.rs).
local ovr = tonumber(ARGV[2])
local g = tonumber(ARGV[6])
local now_us = clock(ARGV[3])
local grant, gkeys = nil, 0
if g == 1 then grant, gkeys = #KEYS, 1 end
local out = decide(0, (#KEYS - gkeys) / (1 + ovr), 6, ARGV[1], now_us, ovr,
                   tonumber(ARGV[4]), tonumber(ARGV[5]), grant)
out[#out + 1] = now_us
if g > 0 or out[2] > 0 then out[#out + 1] = epoch() else out[#out + 1] = 0 end
return out
