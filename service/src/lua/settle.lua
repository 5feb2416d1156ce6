-- Settles reservations (token budgets): the difference between the units a
-- check reserved and those it used is charged, or given back, in the very
-- counter and window the reservation was charged to, whatever the limit's
-- state now (the units were spent: a settlement is never refused). When
-- the window a fixed (or calendar) window's reservation was charged to has
-- ended since, what was used past the reservation is owed: it is charged
-- to the current window (a refund of an ended window is moot). Follows
-- decide.lua.
--
-- KEYS: one counter per limit, followed, when live overrides are on, by
-- the limits' override keys (as decide.lua reads them), then by their
-- epoch keys, then, for a settlement with an id, the key that marks it
-- applied. ARGV: the test clock key, whether overrides are on ('1' or
-- '0'), whether the mark's key follows ('1' or '0'), then SETTLE_ARGS per
-- limit: algorithm, limit (as configured), window_ms, reserved, actual,
-- burst, calendar, and the reservation's receipt: its run's clock
-- (microseconds), nonce, the limit's place in that run, and its
-- subject's epoch then (0: unknown). Returns the units each limit has
-- left now, then the units not given back because their counters were
-- made since their receipts (see below), then 1 when the settlement's id
-- was applied before (and nothing was done), else 0.
--
-- A settlement with an id is applied once: the mark is set as it is
-- applied, and a settlement that finds it set changes nothing (a caller
-- sends again a settlement whose answer it lost: perhaps applied,
-- perhaps not).
--
-- A receipt of another epoch than the subject's now (decide.lua's
-- touch_epoch) was made before Redis lost the counters (a restart
-- without persistence, an eviction of the epoch): the counter of the same
-- name is a new one, made by checks since, that never held its units.
-- Nothing is given back on it (a refund, a lease's return); what was used
-- beyond it is still charged. A sliding log needs no epoch: a return
-- removes its own members, which a new log does not hold.
--
-- A live override replaces the limit (and a burst that was the limit) as
-- it does when checks are decided: a token bucket's units are measured in
-- its emission interval, so a return counted at the configured limit's
-- interval under a raised override gave back many times what was charged.
--
-- Per algorithm: fixed window and sliding counter move the count of the
-- window that was charged (a sliding counter's next window holds it as
-- `p`); the sliding log removes the reservation's last members, or adds
-- members beside them; the token bucket moves its arrival time by the
-- difference (back, never before now).
local SETTLE_ARGS = 11
-- How long the mark of a settlement applied lives (milliseconds).
local SETTLEMENT_ID_MS = 60000
-- How far a fixed window counter's deadline may be from the window's last
-- millisecond and still be that window's: Redis Cluster's MIGRATE moves a
-- key with its time to live, so on its new node it expires a millisecond
-- or two off. Never half a window (the next window's key is a window off).
local MOVED_SLACK_MS = 1000
local now_us = clock(ARGV[1])
local now = math.floor(now_us / 1000)
local ovr = ARGV[2] == '1'
local marked = ARGV[3] == '1'
local m = 0
if marked then m = 1 end
local n = (#KEYS - m) / 2
if ovr then n = (#KEYS - m) / 3 end
-- Applied before: only what each limit has left is read.
local repeated = marked and not redis.call('SET', KEYS[#KEYS], '1', 'NX', 'PX', SETTLEMENT_ID_MS)
local out = {}
local not_given = 0
for i = 1, n do
  local b = 3 + (i - 1) * SETTLE_ARGS
  local alg, limit, window = ARGV[b + 1], tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  local reserved, actual, burst = tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]), tonumber(ARGV[b + 6])
  if ovr then
    local o = tonumber(redis.call('GET', KEYS[n + i]) or '')
    if o and o >= 1 then
      if alg == 'swl' and o > MAX_LOG then o = MAX_LOG end
      if burst == limit then burst = o end
      limit = o
    end
  end
  local cal, at_us, nonce, place = ARGV[b + 7], tonumber(ARGV[b + 8]), ARGV[b + 9], ARGV[b + 10]
  local at = math.floor(at_us / 1000)
  local delta = actual - reserved
  if repeated then delta = 0 end
  local receipt_epoch = tonumber(ARGV[b + 11]) or 0
  if delta < 0 and receipt_epoch ~= 0 and alg ~= 'swl'
     and tonumber(redis.call('GET', KEYS[#KEYS - m - n + i]) or '') ~= receipt_epoch then
    not_given = not_given - delta
    delta = 0
  end
  local key = KEYS[i]
  local remaining = 0
  if alg == 'fw' then
    local reset
    if cal ~= '' then reset = calendar_reset(at, cal) else reset = window - (at % window) end
    local used = tonumber(redis.call('GET', key) or '0')
    local slack = math.max(0, math.min(MOVED_SLACK_MS, math.floor((window - 1) / 2)))
    local deadline = redis.call('PEXPIRETIME', key)
    local ended = at + reset - 1 < now
    if delta ~= 0 and not ended and math.abs(deadline - (at + reset - 1)) <= slack then
      used = redis.call('INCRBY', key, delta)
      if used <= 0 then redis.call('DEL', key); used = 0 end
    elseif delta > 0 and not ended and deadline == -2 then
      -- Its window's counter is gone (Redis lost it): the debt starts it
      -- again, as decide.lua would.
      redis.call('SET', key, delta, 'PXAT', num(at + reset - 1))
      used = delta
    elseif delta > 0 and ended then
      -- Its window has ended: the debt goes into the current one, whose
      -- counter is made as decide.lua makes it when it is missing or of
      -- an ended window.
      local cur_reset
      if cal ~= '' then cur_reset = calendar_reset(now, cal) else cur_reset = window - (now % window) end
      local cur_deadline = now + cur_reset - 1
      if used > 0 and math.abs(deadline - cur_deadline) <= slack then
        used = redis.call('INCRBY', key, delta)
      else
        redis.call('SET', key, delta, 'PXAT', num(cur_deadline))
        used = delta
      end
    end
    remaining = limit - used
  elseif alg == 'swl' then
    local score = num(at_us)
    local function member(j) return score .. ':' .. nonce .. ':' .. place .. ':' .. j end
    local batch = {}
    if delta < 0 then
      for j = actual + 1, reserved do
        batch[#batch + 1] = member(j)
        if #batch >= ZADD_CHUNK or j == reserved then
          redis.call('ZREM', key, unpack(batch))
          batch = {}
        end
      end
    elseif delta > 0 and at_us > now_us - window * 1000 then
      for j = reserved + 1, actual do
        batch[#batch + 1] = score
        batch[#batch + 1] = member(j)
        if #batch >= 2 * ZADD_CHUNK or j == actual then
          redis.call('ZADD', key, unpack(batch))
          batch = {}
        end
      end
      redis.call('PEXPIRE', key, window)
    end
    redis.call('ZREMRANGEBYSCORE', key, '-inf', num(now_us - window * 1000))
    remaining = limit - redis.call('ZCARD', key)
  elseif alg == 'swc' then
    local idx = math.floor(at / window)
    local h = redis.call('HMGET', key, 'w', 'c', 'p')
    local w, c, p = tonumber(h[1]), tonumber(h[2]) or 0, tonumber(h[3]) or 0
    if delta ~= 0 and w == idx then
      c = math.max(0, c + delta)
      redis.call('HSET', key, 'c', num(c))
    elseif delta ~= 0 and w == idx + 1 then
      p = math.max(0, p + delta)
      redis.call('HSET', key, 'p', num(p))
    end
    local cur_idx = math.floor(now / window)
    if delta > 0 and not w and idx >= cur_idx - 1 then
      -- Its counter is gone (Redis lost it) while its window still
      -- counts: the debt starts it again, in its window's place.
      w, c, p = cur_idx, 0, 0
      if idx == cur_idx then c = delta else p = delta end
      redis.call('HSET', key, 'w', num(w), 'c', num(c), 'p', num(p))
      redis.call('PEXPIREAT', key, num((cur_idx + 2) * window))
    end
    local cur, prev = 0, 0
    if w == cur_idx then cur, prev = c, p elseif w == cur_idx - 1 then prev = c end
    remaining = math.floor(limit - (prev * (window - now % window) / window + cur))
  elseif alg == 'tb' then
    local T = window * 1000 / limit
    local tat = tonumber(redis.call('GET', key) or '0')
    if tat < now_us then tat = now_us end
    tat = tat + T * delta
    if tat <= now_us then
      redis.call('DEL', key)
      tat = now_us
    else
      redis.call('SET', key, num(math.ceil(tat)), 'PX', num(math.ceil((tat - now_us) / 1000) + 1))
    end
    remaining = math.floor((T * burst - (tat - now_us)) / T)
  end
  out[i] = math.max(0, remaining)
end
out[n + 1] = not_given
out[n + 2] = repeated and 1 or 0
return out
