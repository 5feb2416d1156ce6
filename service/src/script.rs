//! The Lua script that decides one check on Redis.
//!
//! One script run per check, whatever the number of limits: it reads every
//! counter, decides, and only then charges them, so a denied request
//! consumes nothing anywhere (the seed article's sorted-set version records
//! denied requests too, which keeps a persistent client locked out). The
//! clock is Redis' `TIME`, never the callers' (N replicas, N clocks). A
//! counter gets its expiry in the same run that creates it, and a counter
//! found without one (someone's manual `INCR`) gets it back: no key can
//! outlive its window, unlike `INCR` followed by a separate `EXPIRE`, which
//! leaves an immortal key when the caller dies between the two.
//!
//! Windows are aligned to Redis time (`now - now % window`) and a counter
//! expires exactly at its window's end, so the key needs no window number:
//! one declared key per limit, which is what Redis Cluster wants.
//!
//! KEYS: one per limit, all sharing the subject's hash tag.
//! ARGV: cost, then `requests, window_ms` per limit.
//! Returns: `allowed`, then `ok, remaining, reset_after_ms` per limit.

pub const FIXED_WINDOW: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cost = tonumber(ARGV[1])
local n = #KEYS
local used, reset, fits = {}, {}, {}
local allowed = 1
for i = 1, n do
  local limit = tonumber(ARGV[2 * i])
  local window = tonumber(ARGV[2 * i + 1])
  reset[i] = window - (now % window)
  used[i] = tonumber(redis.call('GET', KEYS[i]) or '0')
  fits[i] = used[i] + cost <= limit
  if not fits[i] then allowed = 0 end
end
local out = { allowed }
for i = 1, n do
  local limit = tonumber(ARGV[2 * i])
  local v = used[i]
  if allowed == 1 then
    v = redis.call('INCRBY', KEYS[i], cost)
    if v == cost or redis.call('PTTL', KEYS[i]) < 0 then
      redis.call('PEXPIREAT', KEYS[i], now + reset[i])
    end
  end
  out[#out + 1] = fits[i] and 1 or 0
  out[#out + 1] = math.max(0, limit - v)
  out[#out + 1] = reset[i]
end
return out
"#;
