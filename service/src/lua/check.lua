-- One check per run: KEYS one per limit; ARGV nonce, then ARGS_PER_LIMIT
-- arguments per limit. Follows decide.lua (see script.rs).
local t = redis.call('TIME')
return decide(0, #KEYS, 1, ARGV[1], tonumber(t[1]) * 1000000 + tonumber(t[2]))
