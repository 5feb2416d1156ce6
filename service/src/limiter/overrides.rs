//! Live overrides (the admin API): stored beside a subject's counters,
//! read by the scripts that decide.

use super::{Limiter, LimiterError};
use crate::keys;

impl Limiter {
    /// The live override of limit `name` (`rule/limit`) for `subject`.
    pub async fn get_override(
        &self,
        name: &str,
        subject: &str,
    ) -> Result<Option<Override>, LimiterError> {
        let values = self.override_op(name, subject, &["get"]).await?;
        Ok(Override::from_reply(&values))
    }

    /// Sets (or replaces) a live override; `expires_at_ms` in Unix
    /// milliseconds, none for an override that lasts until deleted.
    pub async fn set_override(
        &self,
        name: &str,
        subject: &str,
        requests: u64,
        expires_at_ms: Option<u64>,
    ) -> Result<Option<Override>, LimiterError> {
        let requests = requests.to_string();
        let expiry = expires_at_ms.map(|t| t.to_string()).unwrap_or_default();
        let values = self
            .override_op(name, subject, &["set", &requests, &expiry])
            .await?;
        Ok(Override::from_reply(&values))
    }

    /// Removes a live override; whether there was one.
    pub async fn delete_override(&self, name: &str, subject: &str) -> Result<bool, LimiterError> {
        let values = self.override_op(name, subject, &["del"]).await?;
        Ok(values.first().is_some_and(|&n| n > 0))
    }

    /// Names (or, with `add` false, forgets) an override in the index
    /// [`Limiter::indexed_overrides`] reads.
    pub async fn index_override(
        &self,
        name: &str,
        subject: &str,
        add: bool,
    ) -> Result<(), LimiterError> {
        let member = serde_json::to_string(&(name, subject)).unwrap_or_default();
        let mut pipe = redis::pipe();
        pipe.cmd(if add { "SADD" } else { "SREM" })
            .arg(self.override_index_key())
            .arg(member);
        let _: redis::Value = self.query_timed(&pipe).await?;
        Ok(())
    }

    /// Every `(limit, subject)` the index names: the overrides set since
    /// the index exists, some perhaps ended since.
    pub async fn indexed_overrides(&self) -> Result<Vec<(String, String)>, LimiterError> {
        let mut pipe = redis::pipe();
        pipe.cmd("SMEMBERS").arg(self.override_index_key());
        let (members,): (Vec<String>,) = self.query_timed(&pipe).await?;
        Ok(members
            .iter()
            .filter_map(|m| serde_json::from_str(m).ok())
            .collect())
    }

    /// The index of live overrides: one key for the fleet.
    fn override_index_key(&self) -> String {
        format!("{}{{fleet}}:overrides", self.prefix)
    }

    async fn override_op(
        &self,
        name: &str,
        subject: &str,
        args: &[&str],
    ) -> Result<Vec<i64>, LimiterError> {
        let tag = keys::subject_tag(subject);
        let mut invocation = self.scripts.overrides.prepare_invoke();
        invocation.key(keys::override_key(&self.prefix, &tag, name));
        for arg in args {
            invocation.arg(*arg);
        }
        self.run(keys::tag_slot(&tag), &invocation, "overrides")
            .await
    }
}

/// A live override as stored in Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Override {
    pub requests: u64,
    /// Unix milliseconds; none: until deleted.
    pub expires_at_ms: Option<u64>,
}

impl Override {
    fn from_reply(values: &[i64]) -> Option<Override> {
        match values {
            [requests, expiry] => Some(Override {
                requests: (*requests).max(0) as u64,
                expires_at_ms: (*expiry >= 0).then_some(*expiry as u64),
            }),
            _ => None,
        }
    }
}
