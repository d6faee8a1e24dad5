//! Attempt deadlines on timers a serving thread keeps.
//!
//! Owns a lane's spare timers and the race of a future against one. Why
//! not a fresh `tokio::time::timeout` per attempt: arming a new timer puts
//! it into the runtime's timer wheel under the driver's lock and dropping
//! it takes it out again, about 450 instructions per request. A timer that
//! is kept and moved to a later deadline is extended by tokio in place (one
//! atomic exchange) and moved in the wheel only when its old expiry comes
//! round; with the poll that registers the task and this module's own lock,
//! the whole costs about 120 instructions less per request in callgrind. A spare timer still registered fires at its
//! last deadline and wakes the task that last polled it, which then polls
//! once for nothing: harmless, and at most once per request timeout per
//! spare timer.
//!
//! Knows nothing of attempts or workers; used only by [`super::attempt`].

use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::{Mutex, PoisonError};
use std::task::Poll;

use tokio::time::{Instant, Sleep, sleep_until};

/// Spare timers kept at most; more concurrent attempts arm new ones, which
/// are dropped after use.
const MAX_SPARE: usize = 1024;

/// The spare timers of one serving thread. The lock is never contended: a
/// lane's attempts all run on its thread.
#[derive(Default)]
pub(crate) struct Timers(Mutex<Vec<Pin<Box<Sleep>>>>);

/// Why [`Timers::within`] gave up.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Elapsed;

impl Timers {
    /// `future`'s output, or `Elapsed` once `deadline` has passed first.
    pub(crate) async fn within<F: Future>(
        &self,
        deadline: Instant,
        future: F,
    ) -> Result<F::Output, Elapsed> {
        let mut timer = Armed {
            timers: self,
            sleep: Some(self.arm(deadline)),
        };
        let mut future = pin!(future);
        poll_fn(|cx| {
            if let Poll::Ready(output) = future.as_mut().poll(cx) {
                return Poll::Ready(Ok(output));
            }
            timer.sleep().as_mut().poll(cx).map(|()| Err(Elapsed))
        })
        .await
    }

    fn spare(&self) -> std::sync::MutexGuard<'_, Vec<Pin<Box<Sleep>>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn arm(&self, deadline: Instant) -> Pin<Box<Sleep>> {
        match self.spare().pop() {
            Some(mut sleep) => {
                sleep.as_mut().reset(deadline);
                sleep
            }
            None => Box::pin(sleep_until(deadline)),
        }
    }
}

/// A timer in use, back with the spares when dropped.
struct Armed<'a> {
    timers: &'a Timers,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Armed<'_> {
    fn sleep(&mut self) -> &mut Pin<Box<Sleep>> {
        self.sleep.as_mut().expect("taken only on drop")
    }
}

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        if let Some(sleep) = self.sleep.take() {
            let mut spare = self.timers.spare();
            if spare.len() < MAX_SPARE {
                spare.push(sleep);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const SECOND: Duration = Duration::from_secs(1);

    #[tokio::test(start_paused = true)]
    async fn a_future_that_ends_first_wins_and_its_timer_is_kept() {
        let timers = Timers::default();
        let out = timers.within(Instant::now() + SECOND, async { 7 }).await;
        assert_eq!(out, Ok(7));
        assert_eq!(timers.spare().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_kept_timer_moved_later_cuts_at_the_new_deadline_not_the_old() {
        let timers = Timers::default();
        let started = Instant::now();
        // Kept with a deadline one second out...
        timers.within(started + SECOND, async {}).await.unwrap();
        // ...then armed again for ten seconds: the old expiry must not cut it.
        let out = timers
            .within(started + 10 * SECOND, tokio::time::sleep(5 * SECOND))
            .await;
        assert_eq!(out, Ok(()));
        assert_eq!(started.elapsed(), 5 * SECOND);
        let out = timers
            .within(Instant::now() + 2 * SECOND, std::future::pending::<()>())
            .await;
        assert_eq!(out, Err(Elapsed));
        assert_eq!(started.elapsed(), 7 * SECOND);
        assert_eq!(timers.spare().len(), 1, "one timer served all three");
    }

    #[tokio::test(start_paused = true)]
    async fn a_kept_timer_that_fired_is_armed_again() {
        let timers = Timers::default();
        let started = Instant::now();
        let out = timers
            .within(started + 10 * SECOND, std::future::pending::<()>())
            .await;
        assert_eq!(out, Err(Elapsed));
        let out = timers
            .within(Instant::now() + SECOND, std::future::pending::<()>())
            .await;
        assert_eq!(out, Err(Elapsed));
        assert_eq!(started.elapsed(), 11 * SECOND);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_deadlines_each_get_a_timer_and_at_most_the_cap_is_kept() {
        let timers = Timers::default();
        let deadline = Instant::now() + SECOND;
        let many =
            (0..MAX_SPARE + 8).map(|_| timers.within(deadline, std::future::pending::<()>()));
        let outs = futures_join_all(many).await;
        assert!(outs.iter().all(|o| *o == Err(Elapsed)));
        assert_eq!(timers.spare().len(), MAX_SPARE);
    }

    /// Polls every future on this task until all are done.
    async fn futures_join_all<F: Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
        let mut futures: Vec<Pin<Box<F>>> = futures.map(Box::pin).collect();
        let mut outs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
        poll_fn(|cx| {
            for (future, out) in futures.iter_mut().zip(outs.iter_mut()) {
                if out.is_none()
                    && let Poll::Ready(o) = future.as_mut().poll(cx)
                {
                    *out = Some(o);
                }
            }
            if outs.iter().all(Option::is_some) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        outs.into_iter().map(|o| o.expect("all done")).collect()
    }
}
