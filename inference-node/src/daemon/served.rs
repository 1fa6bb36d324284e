//! The model a node daemon serves, chosen by the config's `[model]
//! family`: DeepSeek V4.1's loop (two Engram tables, its tokenizer or
//! token map, speculation) or Qwen4Exp's (one PLE table, raw token ids,
//! each sequence's convolution state). The daemon's queue, batch, API,
//! reloads and self-check are the same for both.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use cluster_config::Config;
use cluster_config::model::Family;

use crate::metrics::NodeMetrics;
use crate::model::ngram::SPECULATION;
use crate::model::ngram::node::{NgramInput, NgramNode};
use crate::model::node::{Backbone, InputChoice, InputTokenizer, NodeModel, SetupError};
use crate::model::{BatchDriver, LoopError, LoopSpec, TableSlot, Tokens};
use crate::router::Router;

/// A node's model loop, of either family.
#[derive(Debug)]
pub enum ServedModel {
    /// DeepSeek V4.1 (`family = "deepseek_v41"`).
    V41(Box<NodeModel>),
    /// Qwen4Exp (`family = "qwen4exp"`).
    Qwen4Exp(Box<NgramNode>),
}

/// What turns a request's input into the loop's tokens, apart from the
/// model (the daemon admits requests while the loop runs).
#[derive(Debug, Clone)]
pub enum Admission {
    /// V4.1's tokenizer or token map.
    V41(Box<InputTokenizer>),
    /// Qwen4Exp's raw ids.
    Qwen4Exp(NgramInput),
}

impl Admission {
    /// `input`'s tokens, repeated until there are at least `min_len`.
    pub fn tokens(&self, input: &InputChoice, min_len: usize) -> Result<Tokens, SetupError> {
        match self {
            Self::V41(t) => t.tokens(input, min_len),
            Self::Qwen4Exp(t) => t.tokens(input, min_len),
        }
    }
}

impl From<NodeModel> for ServedModel {
    fn from(m: NodeModel) -> Self {
        Self::V41(Box::new(m))
    }
}

impl From<NgramNode> for ServedModel {
    fn from(m: NgramNode) -> Self {
        Self::Qwen4Exp(Box::new(m))
    }
}

impl ServedModel {
    /// Build node `name` of `config` for the family its `[model]` names
    /// (V4.1 without one). Must run inside a tokio runtime.
    pub async fn from_config(
        config: &Config,
        name: &str,
        metrics: &NodeMetrics,
    ) -> Result<Self, SetupError> {
        Ok(match config.family() {
            Family::Qwen4Exp => NgramNode::from_config(config, name, None, metrics)
                .await?
                .into(),
            Family::DeepseekV41 => NodeModel::from_config(config, name, None, metrics)
                .await?
                .into(),
        })
    }

    /// Refuse a backbone stand-in this family's loop does not run.
    pub fn check_backbone(&self, backbone: Backbone) -> Result<(), SetupError> {
        match (self, backbone) {
            (Self::Qwen4Exp(_), Backbone::Gpu) => Err(SetupError::Config(
                "--backbone gpu runs DeepSeek V4.1's loop only (docs/models.md)".into(),
            )),
            _ => Ok(()),
        }
    }

    /// The family's name, as `[model] family` spells it.
    pub fn family(&self) -> Family {
        match self {
            Self::V41(_) => Family::DeepseekV41,
            Self::Qwen4Exp(_) => Family::Qwen4Exp,
        }
    }

    /// The tables the loop reads, in its order.
    pub fn slots(&self) -> Vec<TableSlot> {
        match self {
            Self::V41(m) => m.slots().to_vec(),
            Self::Qwen4Exp(m) => vec![m.slot()],
        }
    }

    /// Their routers, in the same order.
    pub fn routers(&self) -> Vec<Arc<Router>> {
        match self {
            Self::V41(m) => m.routers().to_vec(),
            Self::Qwen4Exp(m) => vec![m.router().clone()],
        }
    }

    /// The target rate.
    pub fn tokens_per_second(&self) -> f64 {
        match self {
            Self::V41(m) => m.tokens_per_second(),
            Self::Qwen4Exp(m) => m.tokens_per_second(),
        }
    }

    /// Most sequences batched (the node's `max_batch`).
    pub fn max_batch(&self) -> u32 {
        match self {
            Self::V41(m) => m.max_batch(),
            Self::Qwen4Exp(m) => m.max_batch(),
        }
    }

    /// Prefill positions a step takes beside decoding sequences.
    pub fn prefill_budget(&self) -> usize {
        match self {
            Self::V41(m) => m.prefill_budget(),
            Self::Qwen4Exp(m) => m.prefill_budget(),
        }
    }

    /// The fusion's name.
    pub fn fusion_name(&self) -> &'static str {
        match self {
            Self::V41(m) => m.fusion_name(),
            Self::Qwen4Exp(m) => m.fusion_name(),
        }
    }

    /// Why a request may not speculate (`None`: it may).
    pub fn no_speculation(&self) -> Option<&'static str> {
        match self {
            Self::V41(_) => None,
            Self::Qwen4Exp(_) => Some(SPECULATION),
        }
    }

    /// Why a request may not give text (`None`: it may).
    pub fn no_text(&self) -> Option<&'static str> {
        match self {
            Self::V41(_) => None,
            Self::Qwen4Exp(m) if !m.input().takes_text() => {
                Some(crate::model::ngram::node::NO_TEXT)
            }
            Self::Qwen4Exp(_) => None,
        }
    }

    /// The requests' input, apart from the model.
    pub fn admission(&self) -> Admission {
        match self {
            Self::V41(m) => Admission::V41(Box::new(m.input_tokenizer())),
            Self::Qwen4Exp(m) => Admission::Qwen4Exp(m.input()),
        }
    }

    /// Apply a new config between sequences (each family's `reload`).
    pub fn reload(
        &mut self,
        handle: &tokio::runtime::Handle,
        config: &Config,
        name: &str,
        metrics: &NodeMetrics,
    ) -> Result<String, String> {
        if config.family() != self.family() {
            return Err(format!(
                "[model] family changed from {:?} to {:?}: restart the node to apply it",
                self.family().name(),
                config.family().name()
            ));
        }
        match self {
            Self::V41(m) => m.reload(handle, config, name, metrics),
            Self::Qwen4Exp(m) => m.reload(handle, config, name, metrics),
        }
    }

    /// Run a continuous batch on this thread.
    pub fn run_batch(
        &mut self,
        handle: tokio::runtime::Handle,
        spec: &LoopSpec,
        driver: &mut dyn BatchDriver,
    ) -> Result<(), LoopError> {
        match self {
            Self::V41(m) => m.run_batch(handle, spec, driver),
            Self::Qwen4Exp(m) => m.run_batch(handle, spec, driver),
        }
    }

    /// Run `tokens` through the serving path (the idle self-check).
    pub fn run_check(
        &mut self,
        handle: tokio::runtime::Handle,
        tokens: &Tokens,
        spec: &LoopSpec,
        backbone: Backbone,
    ) -> Result<(), LoopError> {
        let stop = AtomicBool::new(false);
        let mut quiet = |_: &crate::model::StepRecord| Ok(());
        match self {
            Self::V41(m) => m.run(handle, tokens, spec, backbone, &stop, &mut quiet),
            Self::Qwen4Exp(m) => m.run(handle, &tokens.raw, spec, &stop, &mut quiet),
        }
        .map(|_| ())
    }
}
