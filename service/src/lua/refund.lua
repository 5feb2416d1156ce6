-- Gives back what a charge.lua run charged, when another slot of the same
-- check then denied it (a denied request charges nothing). ARGV: the
-- charge's nonce, its clock (microseconds), the test clock key, then
-- REFUND_ARGS per limit: algorithm, limit (as the charge applied it),
-- window_ms, cost, calendar, the limit's place in the charge run. KEYS: the
-- counters, in the same order. Follows decide.lua.
--
-- A refund only touches what the charge wrote: the same fixed window
-- (same deadline), the same window of a sliding counter, the very members
-- of a sliding log; a token bucket's arrival time moves back by the cost,
-- never before now. A window that has ended since is left alone.
local REFUND_ARGS = 6
local nonce, at_us = ARGV[1], tonumber(ARGV[2])
local at = math.floor(at_us / 1000)
local now_us = clock(ARGV[3])
for i = 1, #KEYS do
  local b = 3 + (i - 1) * REFUND_ARGS
  local alg, limit, window, cost, cal, place = ARGV[b + 1], tonumber(ARGV[b + 2]),
    tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), ARGV[b + 5], ARGV[b + 6]
  local key = KEYS[i]
  if alg == 'fw' then
    local reset
    if cal ~= '' then reset = calendar_reset(at, cal) else reset = window - (at % window) end
    if redis.call('PEXPIRETIME', key) == at + reset - 1 then
      if redis.call('DECRBY', key, cost) <= 0 then redis.call('DEL', key) end
    end
  elseif alg == 'swl' then
    local members = {}
    for j = 1, cost do
      members[#members + 1] = num(at_us) .. ':' .. nonce .. ':' .. place .. ':' .. j
      if #members >= ZADD_CHUNK or j == cost then
        redis.call('ZREM', key, unpack(members))
        members = {}
      end
    end
  elseif alg == 'swc' then
    local idx = math.floor(at / window)
    local w = tonumber(redis.call('HGET', key, 'w') or '')
    if w == idx then
      if redis.call('HINCRBY', key, 'c', -cost) < 0 then redis.call('HSET', key, 'c', 0) end
    elseif w == idx + 1 then
      if redis.call('HINCRBY', key, 'p', -cost) < 0 then redis.call('HSET', key, 'p', 0) end
    end
  elseif alg == 'tb' then
    local tat = tonumber(redis.call('GET', key) or '0')
    local back = tat - window * 1000 / limit * cost
    if back <= now_us then redis.call('DEL', key)
    else redis.call('SET', key, num(math.ceil(back)), 'PX', num(math.ceil((back - now_us) / 1000) + 1)) end
  end
end
return { #KEYS }
