//! Calendar windows: fixed windows whose edges are the starts of days,
//! ISO weeks (Mondays) or months, in a stated UTC offset.
//!
//! A monthly quota that resets "on the 1st at midnight, Madrid summer time"
//! is a fixed window from `2028-02-01T00:00+02:00` to `2028-03-01T00:00+02:00`:
//! 29 days that February, 31 in March. meshlimitd's script computes the
//! same edges from Redis `TIME` (`calendar_window` in `decide.lua`, tested
//! against this module); the filter uses this module for its fallback
//! counters and headers. A fixed offset, not a time-zone name: the script
//! has no time-zone database, and an operator who wants summer time
//! changes the offset with the season (docs/policies.md says how).
//!
//! Days are counted with the proleptic Gregorian calendar (leap years every
//! 4 years except centuries not divisible by 400), by H. Hinnant's
//! `days_from_civil` / `civil_from_days`.

use serde::{Deserialize, Serialize};

const DAY_MS: i64 = 86_400_000;

/// Most minutes a UTC offset may be from UTC (the world's offsets span
/// -12:00 to +14:00).
pub const MAX_OFFSET_MINUTES: i32 = 14 * 60;

/// Which calendar edges a window runs between.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CalendarUnit {
    Day,
    /// ISO week: Monday 00:00 to the next Monday.
    Week,
    Month,
}

impl CalendarUnit {
    pub fn as_str(self) -> &'static str {
        match self {
            CalendarUnit::Day => "day",
            CalendarUnit::Week => "week",
            CalendarUnit::Month => "month",
        }
    }

    /// The longest window of this unit (a 31-day month), in milliseconds.
    pub fn max_len_ms(self) -> u64 {
        match self {
            CalendarUnit::Day => DAY_MS as u64,
            CalendarUnit::Week => 7 * DAY_MS as u64,
            CalendarUnit::Month => 31 * DAY_MS as u64,
        }
    }
}

/// A calendar-aligned window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Calendar {
    pub unit: CalendarUnit,
    /// Local time is UTC plus this many minutes (`+02:00` is 120).
    #[serde(default)]
    pub utc_offset_minutes: i32,
}

impl Calendar {
    /// The window holding `now_ms` (Unix milliseconds): its start and end,
    /// in Unix milliseconds, end exclusive.
    pub fn window(&self, now_ms: u64) -> (u64, u64) {
        let offset = i64::from(self.utc_offset_minutes) * 60_000;
        let local = now_ms as i64 + offset;
        let day = local.div_euclid(DAY_MS);
        let (start_day, end_day) = match self.unit {
            CalendarUnit::Day => (day, day + 1),
            CalendarUnit::Week => {
                // 1970-01-01 was a Thursday: Monday-based weekday.
                let monday = day - (day + 3).rem_euclid(7);
                (monday, monday + 7)
            }
            CalendarUnit::Month => {
                let (y, m, _) = civil_from_days(day);
                let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                (days_from_civil(y, m, 1), days_from_civil(ny, nm, 1))
            }
        };
        let edge = |d: i64| (d * DAY_MS - offset).max(0) as u64;
        (edge(start_day), edge(end_day))
    }

    /// A short name for keys and logs: `month+120`.
    pub fn key_suffix(&self) -> String {
        format!("{}{:+}", self.unit.as_str(), self.utc_offset_minutes)
    }

    /// Checks the offset; the error says what it must be.
    pub fn check(&self) -> Result<(), String> {
        if self.utc_offset_minutes.abs() > MAX_OFFSET_MINUTES {
            return Err("utc_offset must be between -14:00 and +14:00".into());
        }
        Ok(())
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date (year, month 1-12, day 1-31) of a day since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unix milliseconds of a UTC date and time.
    fn at(y: i64, m: i64, d: i64, h: i64, min: i64) -> u64 {
        ((days_from_civil(y, m, d) * 24 + h) * 60 + min) as u64 * 60_000
    }

    fn month(offset: i32) -> Calendar {
        Calendar {
            unit: CalendarUnit::Month,
            utc_offset_minutes: offset,
        }
    }

    #[test]
    fn civil_dates_round_trip() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        for z in [-1000, 0, 59, 11_016, 11_017, 20_000, 21_974, 100_000] {
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z);
        }
    }

    #[test]
    fn months_have_their_real_lengths_leap_days_included() {
        let utc = month(0);
        // February 2028 (a leap year): 29 days.
        let (s, e) = utc.window(at(2028, 2, 29, 23, 59));
        assert_eq!((s, e), (at(2028, 2, 1, 0, 0), at(2028, 3, 1, 0, 0)));
        assert_eq!(e - s, 29 * DAY_MS as u64);
        // February 2027: 28. December rolls the year.
        let (s, e) = utc.window(at(2027, 2, 10, 0, 0));
        assert_eq!(e - s, 28 * DAY_MS as u64);
        assert_eq!(utc.window(at(2027, 12, 31, 23, 59)).1, at(2028, 1, 1, 0, 0));
        // 2100 is not a leap year.
        let (s, e) = utc.window(at(2100, 2, 15, 0, 0));
        assert_eq!(e - s, 28 * DAY_MS as u64);
    }

    #[test]
    fn offsets_move_the_edges() {
        // 2028-02-29T23:30Z is already March 1st at +02:00.
        let plus2 = month(120);
        let (s, e) = plus2.window(at(2028, 2, 29, 23, 30));
        assert_eq!(s, at(2028, 2, 29, 22, 0));
        assert_eq!(e, at(2028, 3, 31, 22, 0));
        // ...and still February 29th at -05:00.
        let minus5 = Calendar {
            unit: CalendarUnit::Day,
            utc_offset_minutes: -300,
        };
        let (s, e) = minus5.window(at(2028, 3, 1, 3, 0));
        assert_eq!((s, e), (at(2028, 2, 29, 5, 0), at(2028, 3, 1, 5, 0)));
    }

    #[test]
    fn weeks_start_on_monday() {
        let week = Calendar {
            unit: CalendarUnit::Week,
            utc_offset_minutes: 0,
        };
        // 2028-03-01 is a Wednesday; its week runs Mon 02-28 to Mon 03-06.
        let (s, e) = week.window(at(2028, 3, 1, 12, 0));
        assert_eq!((s, e), (at(2028, 2, 28, 0, 0), at(2028, 3, 6, 0, 0)));
        // Monday 00:00 starts a week; Sunday 23:59 ends one.
        assert_eq!(week.window(at(2028, 3, 6, 0, 0)).0, at(2028, 3, 6, 0, 0));
        assert_eq!(week.window(at(2028, 3, 5, 23, 59)).1, at(2028, 3, 6, 0, 0));
    }

    #[test]
    fn every_instant_lies_in_its_window() {
        for unit in [CalendarUnit::Day, CalendarUnit::Week, CalendarUnit::Month] {
            for offset in [-720, -300, 0, 90, 840] {
                let cal = Calendar {
                    unit,
                    utc_offset_minutes: offset,
                };
                let mut now = at(2027, 12, 25, 0, 0);
                while now < at(2028, 3, 10, 0, 0) {
                    let (s, e) = cal.window(now);
                    assert!(s <= now && now < e, "{cal:?} {now}");
                    assert!(e - s <= unit.max_len_ms());
                    assert_eq!(cal.window(e).0, e, "windows tile");
                    now += 3 * 3_600_000 + 7 * 60_000;
                }
            }
        }
    }
}
