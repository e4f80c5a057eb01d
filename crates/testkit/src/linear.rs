//! A linearizability checker for recorded histories (the Wing–Gong search with Lowe's memo, as
//! Porcupine and Knossos do it).
//!
//! A history is a set of operations, each with the time its call was made and, if an answer
//! came, the time of that answer and the answer. An operation whose answer never came (a
//! timeout, a dropped connection) may have taken effect at any moment after its call, or not
//! at all: it has no return time and no output, and the model is asked what it may have done.
//!
//! The history is linearizable when the operations can be put in one order that respects real
//! time (an operation answered before another was called comes first) in which the model,
//! stepping through them from its initial state, gives every answer that was received.
//! Histories are checked per key (`check` on each key's operations): a model of one register
//! per key is exact when keys are independent (P-compositionality), and small histories keep
//! the search short.

use std::collections::HashSet;
use std::fmt::Debug;
use std::hash::Hash;

/// What the operations act on.
pub trait Model {
    type State: Clone + Eq + Hash + Debug;
    type Input: Debug + PartialEq;
    type Output: Debug;

    fn init(&self) -> Self::State;

    /// The state after `input` in `state`, if it may answer `output` there (`None` as output:
    /// the answer never came, so any answer is allowed; the state is what it did if it took
    /// effect). `None` when the answer is impossible in `state`.
    fn step(&self, state: &Self::State, input: &Self::Input, output: Option<&Self::Output>) -> Option<Self::State>;
}

/// One recorded operation. Times are any monotonic clock's (nanoseconds since the test began).
#[derive(Clone, Debug)]
pub struct Op<I, O> {
    pub call: u64,
    /// `None`: no answer came (the operation may or may not have happened).
    pub ret: Option<u64>,
    pub input: I,
    pub output: Option<O>,
}

#[derive(Clone, Copy, Debug)]
enum Event {
    Call(usize),
    Return(usize),
}

/// How many placements a search tries before it gives up undecided (an error: a test must not
/// hang on a history it cannot decide).
pub const BUDGET: u64 = 5_000_000;

/// Ok when `ops` are linearizable under `model`; else an explanation listing the history.
///
/// Unanswered operations with equal inputs are interchangeable: the search places them in the
/// order of their calls (one called earlier can go wherever a later one could), which keeps a
/// history with many timeouts from multiplying the search by every subset of them.
pub fn check<M: Model>(model: &M, ops: &[Op<M::Input, M::Output>]) -> Result<(), String> {
    // Events by time; at equal times calls come first (two operations touching at an instant
    // count as concurrent, which only ever allows more orders).
    let mut events: Vec<(u64, u8, Event)> = Vec::with_capacity(ops.len() * 2);
    for (i, op) in ops.iter().enumerate() {
        assert!(op.ret.is_none_or(|r| r >= op.call), "operation {i} returns before its call: {op:?}");
        assert_eq!(op.ret.is_some(), op.output.is_some(), "operation {i}: an answer needs a return time: {op:?}");
        events.push((op.call, 0, Event::Call(i)));
        if let Some(r) = op.ret {
            events.push((r, 1, Event::Return(i)));
        }
    }
    events.sort_by_key(|(t, k, _)| (*t, *k));

    // A doubly linked list over the events (index n is the head sentinel).
    let n = events.len();
    let head = n;
    let mut next: Vec<usize> = (1..=n).collect();
    next.push(if n == 0 { usize::MAX } else { 0 });
    let mut prev: Vec<usize> = Vec::with_capacity(n + 1);
    prev.push(head);
    prev.extend(0..n.saturating_sub(1));
    prev.push(usize::MAX);
    if n > 0 {
        next[n - 1] = usize::MAX;
    }
    let mut call_at = vec![usize::MAX; ops.len()];
    let mut ret_at = vec![usize::MAX; ops.len()];
    for (e, (_, _, ev)) in events.iter().enumerate() {
        match *ev {
            Event::Call(i) => call_at[i] = e,
            Event::Return(i) => ret_at[i] = e,
        }
    }

    let unlink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, e: usize| {
        let (p, x) = (prev[e], next[e]);
        next[p] = x;
        if x != usize::MAX {
            prev[x] = p;
        }
    };
    let relink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, e: usize| {
        let (p, x) = (prev[e], next[e]);
        next[p] = e;
        if x != usize::MAX {
            prev[x] = e;
        }
    };

    // For each unanswered operation, the unanswered one with the same input called last
    // before it (ties in call time by index).
    let mut order: Vec<usize> = (0..ops.len()).filter(|i| ops[*i].ret.is_none()).collect();
    order.sort_by_key(|i| (ops[*i].call, *i));
    let mut twin_before = vec![usize::MAX; ops.len()];
    for (k, &i) in order.iter().enumerate() {
        if let Some(&j) = order[..k].iter().rev().find(|&&j| ops[j].input == ops[i].input) {
            twin_before[i] = j;
        }
    }

    let words = ops.len().div_ceil(64);
    let mut done = vec![0u64; words];
    let mut seen: HashSet<(Vec<u64>, M::State)> = HashSet::new();
    let mut stack: Vec<(usize, M::State)> = Vec::new();
    let mut state = model.init();
    let mut returns_left = ops.iter().filter(|o| o.ret.is_some()).count();
    let mut at = next[head];
    let mut best = 0usize;
    let mut steps = 0u64;
    while returns_left > 0 {
        if at == usize::MAX {
            // Only unanswered calls are left ahead and answers remain behind: impossible here.
            unreachable!("the list ends before every return was linearized");
        }
        match events[at].2 {
            Event::Call(i) => {
                let twin = twin_before[i];
                if twin != usize::MAX && done[twin / 64] & (1 << (twin % 64)) == 0 {
                    // Its earlier twin is not placed yet: placing this one instead is the
                    // same choice.
                    at = next[at];
                    continue;
                }
                let stepped = model.step(&state, &ops[i].input, ops[i].output.as_ref());
                let fresh = stepped.and_then(|s| {
                    done[i / 64] |= 1 << (i % 64);
                    let new = seen.insert((done.clone(), s.clone()));
                    if new {
                        Some(s)
                    } else {
                        done[i / 64] &= !(1 << (i % 64));
                        None
                    }
                });
                match fresh {
                    Some(s) => {
                        steps += 1;
                        if steps > BUDGET {
                            return Err(format!("undecided after {BUDGET} placements\n{}", explain(ops, best)));
                        }
                        stack.push((i, std::mem::replace(&mut state, s)));
                        best = best.max(stack.len());
                        unlink(&mut next, &mut prev, call_at[i]);
                        if ret_at[i] != usize::MAX {
                            unlink(&mut next, &mut prev, ret_at[i]);
                            returns_left -= 1;
                        }
                        at = next[head];
                    }
                    None => at = next[at],
                }
            }
            Event::Return(_) => {
                // An operation answered here without having been placed before: undo the
                // last choice and try the next one.
                let Some((i, before)) = stack.pop() else {
                    return Err(explain(ops, best));
                };
                state = before;
                done[i / 64] &= !(1 << (i % 64));
                if ret_at[i] != usize::MAX {
                    relink(&mut next, &mut prev, ret_at[i]);
                    returns_left += 1;
                }
                relink(&mut next, &mut prev, call_at[i]);
                at = next[call_at[i]];
            }
        }
    }
    Ok(())
}

fn explain<I: Debug, O: Debug>(ops: &[Op<I, O>], best: usize) -> String {
    let mut sorted: Vec<&Op<I, O>> = ops.iter().collect();
    sorted.sort_by_key(|o| o.call);
    let mut s = format!(
        "not linearizable: at most {best} of {} operations could be ordered; the history (call, return ns):\n",
        ops.len()
    );
    for o in sorted {
        let ret = o.ret.map_or_else(|| "-".to_string(), |r| r.to_string());
        s.push_str(&format!("  [{} .. {ret}] {:?} -> {:?}\n", o.call, o.input, o.output));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A register of one integer, 0 at first.
    struct Register;
    #[derive(Debug, PartialEq)]
    enum In {
        Write(u32),
        Read,
    }
    impl Model for Register {
        type State = u32;
        type Input = In;
        type Output = u32;
        fn init(&self) -> u32 {
            0
        }
        fn step(&self, s: &u32, i: &In, o: Option<&u32>) -> Option<u32> {
            match i {
                In::Write(v) => Some(*v),
                In::Read => match o {
                    Some(v) if v != s => None,
                    _ => Some(*s),
                },
            }
        }
    }

    fn op(call: u64, ret: Option<u64>, input: In, output: Option<u32>) -> Op<In, u32> {
        Op { call, ret, input, output }
    }

    #[test]
    fn sequential_and_concurrent_histories_that_fit_pass() {
        // Write 1, then read it.
        assert!(check(&Register, &[op(0, Some(1), In::Write(1), Some(0)), op(2, Some(3), In::Read, Some(1))]).is_ok());
        // A read concurrent with a write may see either value.
        for seen in [0, 1] {
            let h = [op(0, Some(10), In::Write(1), Some(0)), op(1, Some(5), In::Read, Some(seen))];
            assert!(check(&Register, &h).is_ok(), "read {seen}");
        }
        // Two reads during one write: old then new is fine.
        let h = [
            op(0, Some(100), In::Write(1), Some(0)),
            op(10, Some(20), In::Read, Some(0)),
            op(30, Some(40), In::Read, Some(1)),
        ];
        assert!(check(&Register, &h).is_ok());
        // An unanswered write may have happened: later reads see it, or never do.
        for seen in [0, 7] {
            let h = [op(0, None, In::Write(7), None), op(10, Some(20), In::Read, Some(seen))];
            assert!(check(&Register, &h).is_ok(), "read {seen}");
        }
        assert!(check(&Register, &[]).is_ok());
    }

    #[test]
    fn stale_and_impossible_reads_fail() {
        // A read after the write answered sees the old value: stale.
        let h = [op(0, Some(1), In::Write(1), Some(0)), op(2, Some(3), In::Read, Some(0))];
        let e = check(&Register, &h).unwrap_err();
        assert!(e.contains("not linearizable"), "{e}");
        // Two reads during one write: new then old is not (the value went back).
        let h = [
            op(0, Some(100), In::Write(1), Some(0)),
            op(10, Some(20), In::Read, Some(1)),
            op(30, Some(40), In::Read, Some(0)),
        ];
        assert!(check(&Register, &h).is_err());
        // A value nobody wrote.
        assert!(check(&Register, &[op(0, None, In::Write(7), None), op(10, Some(20), In::Read, Some(8))]).is_err());
        // An unanswered write seen, then unseen.
        let h =
            [op(0, None, In::Write(7), None), op(10, Some(20), In::Read, Some(7)), op(30, Some(40), In::Read, Some(0))];
        assert!(check(&Register, &h).is_err());
    }

    #[test]
    fn many_unanswered_twins_are_placed_in_call_order() {
        // 20 unanswered writes of 1 and 20 of 2, interleaved, then 40 reads that alternate
        // between the two values: each read needs one more unanswered write placed. Without
        // the twin rule the search would try every subset of the writes.
        let mut h: Vec<Op<In, u32>> = (0..40).map(|i| op(i, None, In::Write(1 + (i % 2) as u32), None)).collect();
        for k in 0..40u64 {
            h.push(op(1000 + 2 * k, Some(1001 + 2 * k), In::Read, Some(1 + (k % 2) as u32)));
        }
        assert!(check(&Register, &h).is_ok());
        // Two alternations more need two writes more than there are.
        h.push(op(2000, Some(2001), In::Read, Some(1)));
        h.push(op(2002, Some(2003), In::Read, Some(2)));
        assert!(check(&Register, &h).is_err());
    }

    #[test]
    fn many_concurrent_operations_are_searched_in_subsets_not_orders() {
        // 14 writers of distinct values all concurrent (14! orders), then reads of the one that
        // came last: the memo of (placed set, state) cuts the search to subsets.
        let mut h: Vec<Op<In, u32>> =
            (0..14).map(|v| op(v, Some(1000 + v), In::Write(v as u32 + 1), Some(0))).collect();
        h.push(op(2000, Some(2001), In::Read, Some(9)));
        h.push(op(2002, Some(2003), In::Read, Some(9)));
        assert!(check(&Register, &h).is_ok());
        h.push(op(2004, Some(2005), In::Read, Some(10)));
        assert!(check(&Register, &h).is_err());
    }
}
