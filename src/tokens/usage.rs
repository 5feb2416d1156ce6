//! What a response used: one number at a dotted path, or a weighted sum of
//! several (input and output tokens priced apart), read from a JSON body or
//! from the events of a stream, in the shapes of the providers people use
//! (`cost.response.provider`).
//!
//! In a stream each path keeps the last value any event gave it, and the
//! usage is their weighted sum: Anthropic reports the input tokens once, in
//! `message_start` (`message.usage.input_tokens`), and the output tokens,
//! counted so far, in each `message_delta` (`usage.output_tokens`).

use serde::Deserialize;
use serde_json::Value;

use super::json;

/// A weighted sum of numbers at dotted paths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageExpr {
    pub terms: Vec<Term>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Term {
    pub path: Vec<String>,
    /// Units charged per token at `path` (output priced above input).
    pub weight: u64,
}

impl UsageExpr {
    /// The number at one dotted path, weight 1.
    pub fn single(path: &str) -> UsageExpr {
        UsageExpr {
            terms: vec![Term {
                path: dotted(path),
                weight: 1,
            }],
        }
    }

    fn sum(paths: &[&str]) -> UsageExpr {
        UsageExpr {
            terms: paths
                .iter()
                .map(|p| Term {
                    path: dotted(p),
                    weight: 1,
                })
                .collect(),
        }
    }

    /// The weighted sum of the terms `value` holds; `None` when it holds
    /// none of them.
    pub fn read(&self, value: &Value) -> Option<u64> {
        let mut found = false;
        let mut total = 0u64;
        for term in &self.terms {
            if let Some(n) = json::number_at(value, &term.path) {
                found = true;
                total = total.saturating_add(n.saturating_mul(term.weight));
            }
        }
        found.then_some(total)
    }

    /// The same from a JSON body; `None` when it is not JSON or holds no
    /// term.
    pub fn read_body(&self, body: &[u8]) -> Option<u64> {
        let value: Value = serde_json::from_slice(body).ok()?;
        self.read(&value)
    }
}

/// A stream's usage so far: the last value each term had.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamUsage {
    last: Vec<Option<u64>>,
}

impl StreamUsage {
    /// Notes the terms of `expr` that `event` carries.
    pub fn see(&mut self, expr: &UsageExpr, event: &Value) {
        self.last.resize(expr.terms.len(), None);
        for (last, term) in self.last.iter_mut().zip(&expr.terms) {
            if let Some(n) = json::number_at(event, &term.path) {
                *last = Some(n);
            }
        }
    }

    /// The weighted sum of the last values; `None` until one was seen.
    pub fn total(&self, expr: &UsageExpr) -> Option<u64> {
        let mut found = false;
        let mut total = 0u64;
        for (last, term) in self.last.iter().zip(&expr.terms) {
            if let Some(n) = last {
                found = true;
                total = total.saturating_add(n.saturating_mul(term.weight));
            }
        }
        found.then_some(total)
    }
}

/// Where each provider reports usage (`cost.response.provider`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Provider {
    /// OpenAI's chat completions (and compatible servers: vLLM, Ollama,
    /// LiteLLM): `usage.total_tokens`, in the last event of a stream with
    /// `stream_options.include_usage`.
    Openai,
    /// OpenAI's responses API: `usage.total_tokens`; streamed in the
    /// `response.completed` event as `response.usage.total_tokens`.
    OpenaiResponses,
    /// Anthropic's messages: `usage.input_tokens + usage.output_tokens`;
    /// streamed in `message_start` and `message_delta`.
    Anthropic,
    /// Google's Gemini: `usageMetadata.totalTokenCount`, in every chunk of
    /// a stream (the last is the total).
    Gemini,
}

impl Provider {
    /// The usage of a JSON response.
    pub fn json(self) -> UsageExpr {
        match self {
            Provider::Openai | Provider::OpenaiResponses => UsageExpr::single("usage.total_tokens"),
            Provider::Anthropic => UsageExpr::sum(&["usage.input_tokens", "usage.output_tokens"]),
            Provider::Gemini => UsageExpr::single("usageMetadata.totalTokenCount"),
        }
    }

    /// The usage of a stream.
    pub fn sse(self) -> UsageExpr {
        match self {
            Provider::Openai => UsageExpr::single("usage.total_tokens"),
            Provider::OpenaiResponses => UsageExpr::single("response.usage.total_tokens"),
            Provider::Anthropic => {
                UsageExpr::sum(&["message.usage.input_tokens", "usage.output_tokens"])
            }
            Provider::Gemini => UsageExpr::single("usageMetadata.totalTokenCount"),
        }
    }
}

fn dotted(path: &str) -> Vec<String> {
    path.split('.').map(str::to_string).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn each_provider_reads_its_own_shape() {
        let cases = [
            (
                Provider::Openai,
                json!({"usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}),
            ),
            (
                Provider::OpenaiResponses,
                json!({"usage": {"input_tokens": 9, "output_tokens": 3, "total_tokens": 12}}),
            ),
            (
                Provider::Anthropic,
                json!({"usage": {"input_tokens": 9, "output_tokens": 3}}),
            ),
            (
                Provider::Gemini,
                json!({"usageMetadata": {"promptTokenCount": 9, "candidatesTokenCount": 3, "totalTokenCount": 12}}),
            ),
        ];
        for (provider, body) in cases {
            assert_eq!(provider.json().read(&body), Some(12), "{provider:?}");
            assert_eq!(
                provider.json().read(&json!({"other": 1})),
                None,
                "{provider:?}"
            );
        }
    }

    #[test]
    fn a_stream_sums_the_last_value_of_each_term() {
        let expr = Provider::Anthropic.sse();
        let mut usage = StreamUsage::default();
        assert_eq!(usage.total(&expr), None);
        for event in [
            json!({"type": "message_start", "message": {"usage": {"input_tokens": 50, "output_tokens": 1}}}),
            json!({"type": "content_block_delta", "delta": {"text": "hi"}}),
            json!({"type": "message_delta", "usage": {"output_tokens": 7}}),
            json!({"type": "message_delta", "usage": {"output_tokens": 15}}),
        ] {
            usage.see(&expr, &event);
        }
        assert_eq!(usage.total(&expr), Some(65));
    }

    #[test]
    fn weights_price_terms_apart_and_never_overflow() {
        let expr = UsageExpr {
            terms: vec![
                Term {
                    path: dotted("usage.input_tokens"),
                    weight: 1,
                },
                Term {
                    path: dotted("usage.output_tokens"),
                    weight: 4,
                },
            ],
        };
        assert_eq!(
            expr.read(&json!({"usage": {"input_tokens": 10, "output_tokens": 5}})),
            Some(30)
        );
        assert_eq!(
            expr.read(&json!({"usage": {"input_tokens": u64::MAX, "output_tokens": u64::MAX}})),
            Some(u64::MAX)
        );
    }
}
