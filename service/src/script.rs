//! The Lua scripts that decide checks on Redis.
//!
//! One decision per check, whatever the number and mix of its limits
//! ([`CHECK`] makes one per run, [`CHECK_MANY`] several, one after the other,
//! each all or nothing on its own). A decision reads every counter of its
//! check, decides, and only then charges them, so a denied
//! request consumes nothing anywhere (the seed article's sorted-set version
//! records denied requests too, which keeps a persistent client locked out).
//! The clock is Redis' `TIME`, never the callers' (N replicas, N clocks).
//! Every key gets its expiry in the same run that writes it, so no key can
//! outlive its usefulness, unlike `INCR` followed by a separate `EXPIRE`,
//! which leaves an immortal key when the caller dies between the two.
//!
//! Algorithms (one declared key per limit, all sharing the subject's hash
//! tag, which is what Redis Cluster wants):
//! - `fw`  fixed window: a counter per window aligned to Redis time, created
//!   with `PEXPIREAT` at the window's end, so the key needs no window number.
//!   A counter found without expiry (a manual `INCR`) gets it back.
//! - `swl` sliding window log: a sorted set of admitted requests (score =
//!   microseconds), trimmed to the window; exact. Members carry a per-call
//!   nonce so requests in the same microsecond stay distinct.
//! - `swc` sliding window counter: a hash `{w, c, p}` (window number, its
//!   count, the previous window's count); the estimate weighs the previous
//!   window by how much of it still overlaps. Constant memory.
//! - `tb`  token bucket as GCRA: one stored theoretical arrival time (TAT,
//!   microseconds). Emission interval `T = window / requests`, capacity
//!   `burst` units; a request of cost `k` fits when `TAT + k*T - burst*T <= now`.
//!
//! Large numbers go to Redis through `string.format('%.0f')`: Lua's default
//! number-to-string conversion keeps 14 digits, which would silently round a
//! microsecond timestamp.
//!
//! KEYS: one per limit.
//! ARGV: nonce, then per limit: algorithm, requests, window_ms, cost, burst,
//!       shadow (0/1).
//! Returns: allowed, then per limit: fits, remaining, reset_after_ms,
//!          retry_after_ms.

/// Arguments per limit after the nonce.
pub const ARGS_PER_LIMIT: usize = 6;
/// Values per limit in the reply after the overall decision.
pub const REPLY_PER_LIMIT: usize = 4;

/// The decision itself, as a Lua function over one check's slice of KEYS
/// and ARGV, shared by [`CHECK`] and [`CHECK_MANY`].
macro_rules! decide_fn {
    () => {
        r#"
local function num(x) return string.format('%.0f', x) end
-- One check: its keys are KEYS[k + 1 .. k + n], its limits' arguments
-- ARGV[a + 1 .. a + 6n]. Returns allowed, then 4 values per limit.
local function decide(k, n, a, nonce, now_us)
local now = math.floor(now_us / 1000)
local st = {}
local allowed = 1
for i = 1, n do
  local b = a + (i - 1) * 6
  local s = { alg = ARGV[b + 1], limit = tonumber(ARGV[b + 2]), window = tonumber(ARGV[b + 3]),
              cost = tonumber(ARGV[b + 4]), burst = tonumber(ARGV[b + 5]), shadow = ARGV[b + 6] == '1' }
  local key, limit, window, cost = KEYS[k + i], s.limit, s.window, s.cost
  if s.alg == 'fw' then
    s.used = tonumber(redis.call('GET', key) or '0')
    s.reset = window - (now % window)
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
local out = { allowed }
for i = 1, n do
  local s, key = st[i], KEYS[k + i]
  local charge = allowed == 1 and s.fits
  local remaining, reset
  if s.alg == 'fw' then
    local used = s.used
    if charge then
      used = redis.call('INCRBY', key, s.cost)
      if used == s.cost or redis.call('PTTL', key) < 0 then
        redis.call('PEXPIREAT', key, num(now + s.reset))
      end
    end
    remaining, reset = s.limit - used, s.reset
  elseif s.alg == 'swl' then
    local used = s.used
    if charge then
      for j = 1, s.cost do
        redis.call('ZADD', key, num(now_us), num(now_us) .. ':' .. nonce .. ':' .. i .. ':' .. j)
      end
      redis.call('PEXPIRE', key, s.window)
      used = used + s.cost
      s.reset = s.window
    end
    remaining, reset = s.limit - used, s.reset
  elseif s.alg == 'swc' then
    local used, cur = s.used, s.cur
    if charge then
      cur = cur + s.cost
      used = used + s.cost
      redis.call('HSET', key, 'w', num(s.idx), 'c', num(cur), 'p', num(s.prev))
      redis.call('PEXPIREAT', key, num((s.idx + 2) * s.window))
    end
    remaining = math.floor(s.limit - used)
    reset = 0
    if cur > 0 then reset = 2 * s.window - s.into
    elseif s.prev > 0 then reset = s.window - s.into end
  elseif s.alg == 'tb' then
    local tat = s.tat
    if charge then
      tat = tat + s.T * s.cost
      redis.call('SET', key, num(math.ceil(tat)), 'PX', num(math.ceil((tat - now_us) / 1000) + 1))
    end
    remaining = math.floor((s.T * s.burst - (tat - now_us)) / s.T)
    reset = math.ceil((tat - now_us) / 1000)
  end
  out[#out + 1] = s.fits and 1 or 0
  out[#out + 1] = math.max(0, remaining)
  out[#out + 1] = math.max(0, reset)
  out[#out + 1] = math.max(0, s.retry)
end
return out
end
"#
    };
}

/// One check per run.
pub const CHECK: &str = concat!(
    decide_fn!(),
    r#"
local t = redis.call('TIME')
return decide(0, #KEYS, 1, ARGV[1], tonumber(t[1]) * 1000000 + tonumber(t[2]))
"#
);

/// Several checks in one run, decided one after the other, each on its own
/// and all or nothing exactly as [`CHECK`] decides it; one `TIME` for all.
///
/// ARGV: nonce, number of checks, then per check: its number of limits and
/// their arguments as for [`CHECK`]. KEYS: every check's keys, in order.
/// Returns every check's reply, concatenated in order.
pub const CHECK_MANY: &str = concat!(
    decide_fn!(),
    r#"
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local out, k, a = {}, 0, 2
for c = 1, tonumber(ARGV[2]) do
  local n = tonumber(ARGV[a + 1])
  local r = decide(k, n, a + 1, ARGV[1] .. '.' .. c, now_us)
  for j = 1, #r do out[#out + 1] = r[j] end
  k = k + n
  a = a + 1 + 6 * n
end
return out
"#
);
