-- One check per run, as check.lua, for a check whose limits live in
-- several Cluster slots (decided one slot at a time, see limiter.rs): the
-- reply ends with the run's clock (microseconds), which a refund of this
-- run needs. ARGV and KEYS as for check.lua.
local ovr = tonumber(ARGV[2])
local now_us = clock(ARGV[3])
local out = decide(0, #KEYS / (1 + ovr), 3, ARGV[1], now_us, ovr)
out[#out + 1] = now_us
return out
