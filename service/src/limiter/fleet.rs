//! The fleet-wide enforcement switch's one key in Redis (see
//! `crate::fleet`): every meshlimitd instance reads it, the admin API
//! writes it.

use meshlimit_protocol::Enforcement;

use super::{Limiter, LimiterError};

/// The switch as stored: the mode, and when it ends by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredSwitch {
    pub enforcement: Enforcement,
    /// Unix milliseconds; `None`: until switched back.
    pub expires_at_ms: Option<u64>,
}

impl Limiter {
    /// The switch's key: one for the fleet (its own hash tag, so one slot
    /// of a Cluster).
    fn switch_key(&self) -> String {
        format!("{}{{fleet}}:enforcement", self.prefix)
    }

    /// The switch as Redis holds it (no key: enforce).
    pub async fn read_switch(&self) -> Result<StoredSwitch, LimiterError> {
        let key = self.switch_key();
        let (value, expiry): (Option<String>, i64) = self
            .query_timed(redis::pipe().get(&key).cmd("PEXPIRETIME").arg(&key))
            .await?;
        Ok(StoredSwitch {
            enforcement: match value.as_deref() {
                Some("shadow") => Enforcement::Shadow,
                _ => Enforcement::Enforce,
            },
            expires_at_ms: u64::try_from(expiry).ok(),
        })
    }

    /// Sets the switch: `shadow` (until `expires_at_ms`, if given), or
    /// back to enforce (the key removed).
    pub async fn write_switch(
        &self,
        enforcement: Enforcement,
        expires_at_ms: Option<u64>,
    ) -> Result<(), LimiterError> {
        let key = self.switch_key();
        let mut pipe = redis::pipe();
        match (enforcement, expires_at_ms) {
            (Enforcement::Shadow, Some(at)) => {
                pipe.cmd("SET").arg(&key).arg("shadow").arg("PXAT").arg(at)
            }
            (Enforcement::Shadow, None) => pipe.cmd("SET").arg(&key).arg("shadow"),
            _ => pipe.cmd("DEL").arg(&key),
        };
        let _: redis::Value = self.query_timed(&pipe).await?;
        Ok(())
    }

    /// A pipeline within the Redis timeout.
    pub(super) async fn query_timed<T: redis::FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
    ) -> Result<T, LimiterError> {
        match tokio::time::timeout(self.timeout, self.backend.query_pipe(pipe)).await {
            Err(_) => Err(LimiterError::Timeout(self.timeout)),
            Ok(Err(e)) => Err(LimiterError::Redis(e)),
            Ok(Ok(v)) => Ok(v),
        }
    }
}
