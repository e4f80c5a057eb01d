//! The one periodic loop every component runs its background rounds with: a round, then a rest
//! of `period`, and again, until `stop` resolves. The rest is counted from the end of a round,
//! so a slow round (probing a thousand sandboxes) never makes rounds run back to back.
//! `stop` ends the wait between rounds at once; a round in progress is either finished first
//! ([`Cancel::BetweenRounds`]: rounds that change state, e.g. stopping expired sandboxes) or
//! dropped where it is ([`Cancel::Anytime`]: rounds that only read, e.g. polling IAM).

use std::future::Future;
use std::time::Duration;

/// Where `stop` may cut a loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cancel {
    /// Only between rounds: a round, once started, finishes.
    BetweenRounds,
    /// Also inside a round.
    Anytime,
}

/// When the first round runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// At once.
    Now,
    /// After one period.
    AfterOnePeriod,
}

/// Runs `round`, rests `period`, and again, until `stop` resolves.
pub async fn every<F, Fut>(period: Duration, start: Start, cancel: Cancel, stop: impl Future<Output = ()>, mut round: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let period = period.max(Duration::from_millis(1));
    let mut rest = match start {
        Start::Now => Duration::ZERO,
        Start::AfterOnePeriod => period,
    };
    tokio::pin!(stop);
    loop {
        tokio::select! {
            biased;
            _ = &mut stop => return,
            _ = tokio::time::sleep(rest) => {}
        }
        rest = period;
        match cancel {
            Cancel::BetweenRounds => round().await,
            Cancel::Anytime => tokio::select! {
                biased;
                _ = &mut stop => return,
                _ = round() => {}
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn rounds_come_every_period_and_stop_ends_the_loop() {
        let rounds = Arc::new(AtomicU32::new(0));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let r = rounds.clone();
        let task = tokio::spawn(every(
            Duration::from_secs(10),
            Start::AfterOnePeriod,
            Cancel::BetweenRounds,
            async move {
                let _ = rx.await;
            },
            move || {
                let r = r.clone();
                async move {
                    r.fetch_add(1, Ordering::SeqCst);
                }
            },
        ));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(rounds.load(Ordering::SeqCst), 0, "the first round waits one period");
        tokio::time::sleep(Duration::from_secs(31)).await;
        assert_eq!(rounds.load(Ordering::SeqCst), 3);
        tx.send(()).unwrap();
        task.await.unwrap();
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(rounds.load(Ordering::SeqCst), 3, "no round after stop");
    }

    #[tokio::test(start_paused = true)]
    async fn the_rest_is_counted_from_the_end_of_a_round() {
        let starts = Arc::new(std::sync::Mutex::new(Vec::new()));
        let t0 = tokio::time::Instant::now();
        let s = starts.clone();
        let task = tokio::spawn(every(
            Duration::from_secs(10),
            Start::Now,
            Cancel::BetweenRounds,
            std::future::pending(),
            move || {
                let s = s.clone();
                async move {
                    s.lock().unwrap().push(t0.elapsed().as_secs());
                    tokio::time::sleep(Duration::from_secs(25)).await; // a slow round
                }
            },
        ));
        tokio::time::sleep(Duration::from_secs(75)).await;
        task.abort();
        assert_eq!(*starts.lock().unwrap(), vec![0, 35, 70], "a 10 s rest after each 25 s round");
    }

    #[tokio::test(start_paused = true)]
    async fn a_round_in_progress_finishes_or_is_dropped_as_asked() {
        for (cancel, finished) in [(Cancel::BetweenRounds, 1), (Cancel::Anytime, 0)] {
            let done = Arc::new(AtomicU32::new(0));
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let d = done.clone();
            let task = tokio::spawn(every(
                Duration::from_secs(1),
                Start::Now,
                cancel,
                async move {
                    let _ = rx.await;
                },
                move || {
                    let d = d.clone();
                    async move {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        d.fetch_add(1, Ordering::SeqCst);
                    }
                },
            ));
            tokio::time::sleep(Duration::from_secs(5)).await; // inside the first round
            tx.send(()).unwrap();
            task.await.unwrap();
            assert_eq!(done.load(Ordering::SeqCst), finished, "{cancel:?}");
        }
    }
}
