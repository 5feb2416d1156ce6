-- One check per run. ARGV: nonce, overrides (0/1), test clock key ('' in
-- production), then ARGS_PER_LIMIT arguments per limit. KEYS: one counter
-- per limit, then, with overrides, one override key per limit. Follows
-- decide.lua (see script.rs).
local ovr = tonumber(ARGV[2])
return decide(0, #KEYS / (1 + ovr), 3, ARGV[1], clock(ARGV[3]), ovr)
