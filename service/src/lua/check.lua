-- One check per run: KEYS one per limit (then, with overrides, one
-- override key per limit); ARGV nonce, overrides (0/1), test clock key (''
-- in production), then ARGS_PER_LIMIT arguments per limit. Returns the
-- decision, then the run's clock (microseconds: with the nonce, the
-- receipt of a reservation). Follows decide.lua (see script.rs).
local ovr = tonumber(ARGV[2])
local now_us = clock(ARGV[3])
local out = decide(0, #KEYS / (1 + ovr), 3, ARGV[1], now_us, ovr)
out[#out + 1] = now_us
return out
