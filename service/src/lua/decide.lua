-- meshlimit: the decision of one check on Redis, shared by check.lua and
-- check_many.lua (script.rs puts this file in front of each). What it does
-- and why is told in script.rs; the algorithms are:
-- fw  fixed window, swl sliding window log, swc sliding window counter,
-- tb  token bucket (GCRA).

-- Argument layout, also named in script.rs (a unit test compares them):
-- ARGS_PER_LIMIT arguments per limit (algorithm, requests, window_ms, cost,
-- burst, shadow, calendar), REPLY_PER_LIMIT reply values per limit (fits,
-- remaining, reset_after_ms, retry_after_ms, limit, epoch) after the
-- overall decision.
local ARGS_PER_LIMIT = 7
local REPLY_PER_LIMIT = 6
-- Members per ZADD (well under Lua's limit on unpack()).
local ZADD_CHUNK = 1000
-- A live override never makes a sliding log longer than the API allows
-- (protocol::bounds::MAX_SLIDING_LOG_REQUESTS).
local MAX_LOG = 10000
local DAY = 86400000
-- No lease of a share under this many units: it would save a few calls,
-- and held by one Envoy it is a large part of what is left (another is
-- refused it until it comes back). The last units of a window are then
-- decided one by one.
local MIN_LEASE_SHARE = 8
-- No lease on a limit under this many units a window, whatever is left of
-- it: too small to split between replicas without a client seeing it (a
-- replica holding units while another refuses its client; through four
-- replicas a client of 20 a minute got 17). Its requests are decided one
-- by one, as exact as without leases.
local MIN_LEASED_LIMIT = 64
-- How long a grant's record lives (milliseconds): long enough for a caller
-- whose answer was lost to name the ask in its next call, which goes out
-- within a tick, or once its breaker lets a call through.
local GRANT_RECORD_MS = 10000

-- Large numbers go to Redis through '%.0f': Lua's default conversion keeps
-- 14 digits, which would silently round a microsecond timestamp.
local function num(x) return string.format('%.0f', x) end

-- Calendar windows, as protocol/src/calendar.rs computes them (H. Hinnant's
-- civil-date algorithms, proleptic Gregorian).
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local doy = math.floor((153 * ((m + 9) % 12) + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
                          - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

-- Milliseconds from `now` to the end of its calendar window; `cal` is
-- 'day:<offset minutes>', 'week:..' or 'month:..'.
local function calendar_reset(now, cal)
  local unit, off = string.match(cal, '^(%a+):(-?%d+)$')
  off = tonumber(off) * 60000
  local day = math.floor((now + off) / DAY)
  local last
  if unit == 'day' then last = day + 1
  elseif unit == 'week' then last = day - ((day + 3) % 7) + 7
  else
    local y, m = civil_from_days(day)
    if m == 12 then y, m = y + 1, 1 else m = m + 1 end
    last = days_from_civil(y, m, 1)
  end
  return last * DAY - off - now
end

-- The epoch of a subject's counters: the clock of the run that found its
-- key missing and made it. It lives beside the counters (same hash tag,
-- hence the same slot: it moves with them when a Cluster slot moves) and
-- at least as long as any counter charged by a run that read it, so while
-- it keeps its value those counters were never lost and made anew. A
-- restart without persistence loses it with them: a receipt of the old
-- epoch then names counters that never held its units, and settle.lua
-- gives nothing back on it. `epochs_read` keeps what this run read (a
-- check's limits often share a subject): key -> { epoch, deadline }.
local epochs_read = {}
local function touch_epoch(key, now_us, deadline)
  local e = epochs_read[key]
  if not e then
    e = { tonumber(redis.call('GET', key) or ''), redis.call('PEXPIRETIME', key) }
    if not e[1] then
      e = { now_us, deadline }
      redis.call('SET', key, num(now_us), 'PXAT', num(deadline))
    end
    epochs_read[key] = e
  end
  if e[2] < deadline then
    redis.call('PEXPIREAT', key, num(deadline))
    e[2] = deadline
  end
  return e[1]
end

-- The clock of a run: Redis TIME in microseconds, shifted by the value
-- (milliseconds) of the key named `clock_key` when meshlimitd runs with
-- its test hook (--test-clock-offset-key); '' in production.
local function clock(clock_key)
  local t = redis.call('TIME')
  local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if clock_key ~= '' then
    now_us = now_us + 1000 * (tonumber(redis.call('GET', clock_key) or '0') or 0)
  end
  return now_us
end

-- One check: its counters are KEYS[k + 1 .. k + n], followed, when `ovr`
-- is 1 (live overrides on), by the limits' override keys
-- KEYS[k + n + 1 .. k + 2n]; its limits' arguments are
-- ARGV[a + 1 .. a + ARGS_PER_LIMIT * n]. `want` and `share` ask for a
-- lease (0 and 1 for none): up to `want` units more on every limit, at
-- most what the tightest limit has left after the request divided by
-- `share`. `grant` is the KEYS index of the check's record, or nil (a
-- lease ask's, or a reservation's, with an id): what an admitted check
-- charged is recorded there when it was granted a lease or reserved
-- ('<units charged on each limit, comma-separated> <clock> <nonce>': the
-- request's cost and the lease), and a check already named lost there
-- ('lost') is charged nothing. `epochs` is nil, or the KEYS offset of the
-- limits' epoch keys (limit i's at KEYS[epochs + i]): when the check has
-- receipts (it asked for them, `receipt`, or was granted a lease), each
-- limit charged replies its subject's epoch (see touch_epoch; 0
-- otherwise, and on a sliding log, whose returns remove its own
-- members). Returns allowed, the units leased, then REPLY_PER_LIMIT
-- values per limit (remaining after the lease).
local function decide(k, n, a, nonce, now_us, ovr, want, share, grant, epochs, receipt)
local now = math.floor(now_us / 1000)
local st = {}
local allowed = 1
for i = 1, n do
  local b = a + (i - 1) * ARGS_PER_LIMIT
  local s = { alg = ARGV[b + 1], limit = tonumber(ARGV[b + 2]), window = tonumber(ARGV[b + 3]),
              cost = tonumber(ARGV[b + 4]), burst = tonumber(ARGV[b + 5]), shadow = ARGV[b + 6] == '1',
              cal = ARGV[b + 7] }
  if ovr == 1 then
    -- A live override (meshlimitd's admin API) replaces the limit, and a
    -- burst that was the limit; it expires with its key.
    local o = tonumber(redis.call('GET', KEYS[k + n + i]) or '')
    if o and o >= 1 then
      if s.alg == 'swl' and o > MAX_LOG then o = MAX_LOG end
      if s.burst == s.limit then s.burst = o end
      s.limit = o
    end
  end
  local key, limit, window, cost = KEYS[k + i], s.limit, s.window, s.cost
  if s.alg == 'fw' then
    s.used = tonumber(redis.call('GET', key) or '0')
    if s.used > 0 then
      -- A counter whose deadline is before now (TIME's clock) belongs to a
      -- window that has ended, even if Redis, whose expiry clock for this
      -- run may be a millisecond behind TIME, still keeps it.
      local at = redis.call('PEXPIRETIME', key)
      if at >= 0 and at < now then s.used, s.stale = 0, true end
    end
    if s.cal ~= '' then s.reset = calendar_reset(now, s.cal)
    else s.reset = window - (now % window) end
    s.fits = s.used + cost <= limit
    s.retry = s.reset
  elseif s.alg == 'swl' then
    local window_us = window * 1000
    redis.call('ZREMRANGEBYSCORE', key, '-inf', num(now_us - window_us))
    s.used = redis.call('ZCARD', key)
    s.fits = s.used + cost <= limit
    s.retry = 0
    if not s.fits and cost <= limit then
      -- The request fits once enough of the oldest admissions have left.
      local k = s.used + cost - limit - 1
      local e = redis.call('ZRANGE', key, k, k, 'WITHSCORES')
      s.retry = math.ceil((tonumber(e[2]) + window_us - now_us) / 1000)
    end
    local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    s.reset = 0
    if newest[2] then s.reset = math.ceil((tonumber(newest[2]) + window_us - now_us) / 1000) end
  elseif s.alg == 'swc' then
    local idx = math.floor(now / window)
    local h = redis.call('HMGET', key, 'w', 'c', 'p')
    local w, c, p = tonumber(h[1]), tonumber(h[2]) or 0, tonumber(h[3]) or 0
    local cur, prev = 0, 0
    if w == idx then cur, prev = c, p elseif w == idx - 1 then prev = c end
    local into = now % window
    s.idx, s.cur, s.prev, s.into = idx, cur, prev, into
    s.used = prev * (window - into) / window + cur
    s.fits = s.used + cost <= limit
    s.retry = 0
    if not s.fits and cost <= limit then
      if cur + cost <= limit and prev > 0 then
        -- Later in this window, once enough of the previous one has slid out.
        local f = 1 - (limit - cur - cost) / prev
        s.retry = math.max(1, math.ceil(f * window - into))
      else
        -- Next window: this window's count becomes the weighted one.
        local f = 0
        if cur > 0 then f = math.max(0, 1 - (limit - cost) / cur) end
        s.retry = math.max(1, math.ceil(window - into + f * window))
      end
    end
  elseif s.alg == 'tb' then
    local T = window * 1000 / limit
    local tat = tonumber(redis.call('GET', key) or '0')
    if tat < now_us then tat = now_us end
    local allow_at = tat + T * cost - T * s.burst
    s.T, s.tat = T, tat
    s.fits = allow_at <= now_us
    s.retry = math.ceil((allow_at - now_us) / 1000)
  end
  if s.fits then s.retry = 0 end
  if not s.fits and not s.shadow then allowed = 0 end
  st[i] = s
end
-- A lease: the same number of units on every limit, only what fits after
-- the request on the tightest one, divided by `share`, and none when that
-- is under MIN_LEASE_SHARE; none on a limit under MIN_LEASED_LIMIT, on a
-- sliding log (its members carry times) or where a limit does not fit.
local leased = 0
if grant and redis.call('GET', KEYS[grant]) == 'lost' then
  -- Named lost before this run: its caller decided the request without
  -- meshlimitd, and reads no answer. Charged nothing (answered refused).
  want, allowed = 0, 0
end
if allowed == 1 and want > 0 then
  leased = want
  for i = 1, n do
    local s, room = st[i], 0
    if s.fits and s.alg == 'fw' then room = s.limit - s.used - s.cost
    elseif s.fits and s.alg == 'swc' then room = math.floor(s.limit - s.used - s.cost)
    elseif s.fits and s.alg == 'tb' then
      room = math.floor((s.T * s.burst - (s.tat + s.T * s.cost - now_us)) / s.T)
    end
    local fits = math.floor(math.max(0, room) / share)
    if fits < MIN_LEASE_SHARE or s.limit < MIN_LEASED_LIMIT then fits = 0 end
    leased = math.min(leased, fits)
  end
end
if grant and allowed == 1 and (leased > 0 or receipt) then
  -- What each limit was charged (a reservation's limits may differ; a
  -- shadow limit that did not fit was charged nothing).
  local units = {}
  for i = 1, n do units[i] = st[i].fits and num(st[i].cost + leased) or '0' end
  redis.call('SET', KEYS[grant], table.concat(units, ',') .. ' ' .. num(now_us) .. ' ' .. nonce,
             'PX', GRANT_RECORD_MS)
end
local out = { allowed, leased }
for i = 1, n do
  local s, key = st[i], KEYS[k + i]
  local charge = allowed == 1 and s.fits
  -- What this limit is charged: the request's cost and the lease.
  local units = s.cost + leased
  local remaining, reset
  -- The last millisecond this limit's counter may live (for its epoch).
  local lives = now + s.window
  if s.alg == 'fw' then
    local used = s.used
    -- The deadline is the window's last millisecond: Redis keeps a key
    -- alive while its clock equals the deadline, so a deadline at the
    -- window's end would hand the new window's first millisecond to the
    -- old count (a deny with a full window's retry, or an increment lost
    -- with the dying key).
    if charge and s.stale then
      redis.call('SET', key, units, 'PXAT', num(now + s.reset - 1))
      used = units
    elseif charge then
      used = redis.call('INCRBY', key, units)
      if used == units or redis.call('PTTL', key) < 0 then
        redis.call('PEXPIREAT', key, num(now + s.reset - 1))
      end
    end
    remaining, reset = s.limit - used, s.reset
    lives = now + s.reset - 1
  elseif s.alg == 'swl' then
    local used = s.used
    if charge then
      -- One ZADD per ZADD_CHUNK members, not one per member: the work of
      -- a check stays bounded (cost <= requests <= the sliding log's
      -- maximum, see protocol::bounds).
      local args, score = {}, num(now_us)
      for j = 1, s.cost do
        args[#args + 1] = score
        args[#args + 1] = score .. ':' .. nonce .. ':' .. i .. ':' .. j
        if #args >= 2 * ZADD_CHUNK or j == s.cost then
          redis.call('ZADD', key, unpack(args))
          args = {}
        end
      end
      redis.call('PEXPIRE', key, s.window)
      used = used + s.cost
      s.reset = s.window
    end
    remaining, reset = s.limit - used, s.reset
  elseif s.alg == 'swc' then
    local used, cur = s.used, s.cur
    if charge then
      cur = cur + units
      used = used + units
      redis.call('HSET', key, 'w', num(s.idx), 'c', num(cur), 'p', num(s.prev))
      redis.call('PEXPIREAT', key, num((s.idx + 2) * s.window))
    end
    remaining = math.floor(s.limit - used)
    lives = (s.idx + 2) * s.window
    reset = 0
    if cur > 0 then reset = 2 * s.window - s.into
    elseif s.prev > 0 then reset = s.window - s.into end
  elseif s.alg == 'tb' then
    local tat = s.tat
    if charge then
      tat = tat + s.T * units
      redis.call('SET', key, num(math.ceil(tat)), 'PX', num(math.ceil((tat - now_us) / 1000) + 1))
    end
    remaining = math.floor((s.T * s.burst - (tat - now_us)) / s.T)
    reset = math.ceil((tat - now_us) / 1000)
    lives = now + reset + 1
  end
  local epoch = 0
  if epochs and charge and s.alg ~= 'swl' and (receipt or leased > 0) then
    -- A window more than the counter needs: its deadline is then moved
    -- about once a window, not by every run.
    epoch = touch_epoch(KEYS[epochs + i], now_us, lives + s.window)
  end
  local reply = { s.fits and 1 or 0, math.max(0, remaining), math.max(0, reset), math.max(0, s.retry),
                  s.limit, epoch }
  for j = 1, REPLY_PER_LIMIT do out[#out + 1] = reply[j] end
end
return out
end
