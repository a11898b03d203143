//! What callers send the writer thread (operations, batched) and how
//! answers come back: by a oneshot, or through the caller's runtime's
//! courier so that a batch wakes each runtime once.

use std::time::Duration;

use tokio::sync::oneshot;

use crate::store::api::{Advance, Claim, Lock, StoreError};

/// Upper bound on operations per transaction, so one batch's latency stays
/// bounded under a flood.
pub(super) const MAX_BATCH: usize = 8192;

pub(super) enum Op {
    Advance {
        key: String,
        token: u64,
        reply: oneshot::Sender<Result<Advance, StoreError>>,
    },
    /// An advance and a mark of the key, in one commit.
    AdvanceMarked {
        key: String,
        token: u64,
        reply: oneshot::Sender<Result<(Advance, u64), StoreError>>,
    },
    Mark {
        key: String,
        token: u64,
        reply: oneshot::Sender<Result<u64, StoreError>>,
    },
    Rotate {
        /// Each with the lowest token it has in flight.
        keys: Vec<(String, u64)>,
        watermark: u64,
        reply: oneshot::Sender<Result<Vec<u64>, StoreError>>,
    },
    Get {
        key: String,
        reply: oneshot::Sender<Result<Option<u64>, StoreError>>,
    },
    Forget {
        key: String,
        reply: oneshot::Sender<Result<Option<u64>, StoreError>>,
    },
    Lock {
        key: String,
        op: LockOp,
        reply: oneshot::Sender<Result<LockAnswer, StoreError>>,
    },
    Ping {
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    KeyMapping {
        fingerprint: u64,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    CloseClean {
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
}

/// A lock-service operation ([`FenceStore::claim_lock`] and its kin).
pub(super) enum LockOp {
    Claim {
        id: String,
        holder: String,
        ttl: Duration,
    },
    Read,
    Renew {
        id: String,
        ttl: Duration,
    },
    Release {
        id: String,
    },
}

pub(super) enum LockAnswer {
    Claim(Claim),
    Lock(Option<Lock>),
    Released(bool),
}

/// Answers of one batch for the callers on one runtime.
pub(super) type Answers = Vec<(Op, Result<Answer, StoreError>)>;

/// Carries a batch's answers to a task on the callers' runtime, which
/// hands them out there. Answering each caller from the writer thread
/// would wake its runtime from outside once per operation (a system call
/// each on a single-threaded runtime); this wakes it once per batch.
pub(super) type Courier = tokio::sync::mpsc::UnboundedSender<Answers>;

/// One operation's result inside a committed batch.
pub(super) enum Answer {
    Advance(Advance),
    /// An advance and the sequence number of its mark.
    Marked(Advance, u64),
    Seq(u64),
    Seqs(Vec<u64>),
    Token(Option<u64>),
    Lock(LockAnswer),
    Done,
    /// An advance after the clean-stop mark.
    Refused,
}

impl Op {
    /// Sends the batch's outcome for this operation to its caller.
    pub(super) fn answer(self, result: Result<Answer, StoreError>) {
        // A caller that went away no longer needs its answer.
        match self {
            Op::Advance { reply, .. } => drop(reply.send(result.and_then(|a| match a {
                Answer::Advance(a) => Ok(a),
                _ => Err(StoreError::Closed),
            }))),
            Op::Get { reply, .. } | Op::Forget { reply, .. } => {
                drop(reply.send(result.map(|a| match a {
                    Answer::Token(t) => t,
                    _ => None,
                })))
            }
            Op::Lock { reply, .. } => drop(reply.send(result.and_then(|a| match a {
                Answer::Lock(l) => Ok(l),
                _ => Err(StoreError::Closed),
            }))),
            Op::Ping { reply } | Op::CloseClean { reply } | Op::KeyMapping { reply, .. } => {
                drop(reply.send(result.map(|_| ())))
            }
            Op::AdvanceMarked { reply, .. } => drop(reply.send(result.and_then(|a| match a {
                Answer::Marked(a, seq) => Ok((a, seq)),
                _ => Err(StoreError::Closed),
            }))),
            Op::Mark { reply, .. } => drop(reply.send(result.and_then(|a| match a {
                Answer::Seq(seq) => Ok(seq),
                _ => Err(StoreError::Closed),
            }))),
            Op::Rotate { reply, .. } => drop(reply.send(result.and_then(|a| match a {
                Answer::Seqs(seqs) => Ok(seqs),
                _ => Err(StoreError::Closed),
            }))),
        }
    }
}

/// Hands each operation its answer: through its runtime's courier, one
/// message per courier, or directly (no courier, or its runtime is gone).
pub(super) fn deliver(
    ops: impl Iterator<Item = Op>,
    couriers: impl Iterator<Item = Option<Courier>>,
    answers: Vec<Result<Answer, StoreError>>,
) {
    let mut groups: Vec<(Courier, Answers)> = Vec::new();
    for ((op, courier), answer) in ops.zip(couriers).zip(answers) {
        match courier {
            None => op.answer(answer),
            Some(c) => match groups.iter_mut().find(|(g, _)| g.same_channel(&c)) {
                Some((_, group)) => group.push((op, answer)),
                None => groups.push((c, vec![(op, answer)])),
            },
        }
    }
    for (courier, group) in groups {
        if let Err(returned) = courier.send(group) {
            for (op, answer) in returned.0 {
                op.answer(answer);
            }
        }
    }
}
