//! Running several futures on the current task (a token's tables are
//! fetched together; a wide prefill's messages are sent together).

/// Run futures concurrently on this task (a token's tables are fetched together).
pub(crate) async fn join_all<F: Future<Output = ()>>(futs: impl Iterator<Item = F>) {
    join_all_results(futs).await;
}

/// Run futures concurrently on this task; their outputs, in order.
pub(crate) async fn join_all_results<F: Future>(futs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut futs: Vec<std::pin::Pin<Box<F>>> = futs.map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}
