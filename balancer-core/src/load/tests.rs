use super::*;
use crate::clock::{Clock, ManualClock};

/// The shape of a vLLM v0.11 `/metrics` page: HELP and TYPE lines, the
/// `engine` and `model_name` labels, counters, histograms and the Python
/// process series around the ones the gateway reads.
const VLLM: &str = r#"# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 14123.0
python_gc_objects_collected_total{generation="1"} 3510.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4213
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 182736.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7331234567890825e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="meta-llama/Llama-3.1-8B-Instruct"} 120.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 131.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 131.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.91
# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7331234567890825e+09
"#;

/// SGLang's `--enable-metrics` page: its own names, `model_name` and
/// parallelism labels.
const SGLANG: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0",dp_rank="0"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0",dp_rank="0"} 5.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0",dp_rank="0"} 0.87
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="Qwen/Qwen2.5-7B-Instruct",tp_rank="0",dp_rank="0"} 0.61
"#;

#[test]
fn reads_vllm_queue_and_cache() {
    assert_eq!(
        parse_exposition(VLLM),
        Ok(ReportedLoad {
            waiting: 3,
            running: 7,
            cache_usage: Some(0.4213),
        })
    );
}

#[test]
fn reads_sglang_queue_and_cache() {
    assert_eq!(
        parse_exposition(SGLANG),
        Ok(ReportedLoad {
            waiting: 5,
            running: 12,
            cache_usage: Some(0.87),
        })
    );
}

#[test]
fn data_parallel_engines_add_their_queues_and_the_fullest_cache_counts() {
    let text = "# TYPE vllm:num_requests_waiting gauge\n\
        vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2\n\
        vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 4\n\
        # TYPE vllm:num_requests_running gauge\n\
        vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1\n\
        vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 1\n\
        # TYPE vllm:gpu_cache_usage_perc gauge\n\
        vllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
        vllm:gpu_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.75\n";
    assert_eq!(
        parse_exposition(text),
        Ok(ReportedLoad {
            waiting: 6,
            running: 2,
            cache_usage: Some(0.75),
        })
    );
}

#[test]
fn a_queue_without_cache_usage_still_reports() {
    let load = parse_exposition("vllm:num_requests_waiting 1\n").unwrap();
    assert_eq!((load.waiting, load.running, load.cache_usage), (1, 0, None));
}

#[test]
fn malformed_text_is_an_error() {
    for text in [
        // An unclosed label set.
        "vllm:num_requests_waiting{engine=\"0\" 3\n",
        // A line that is no sample at all.
        "vllm:num_requests_waiting 3\n<html>Bad Gateway</html>\n",
        // A value that is no number.
        "vllm:num_requests_waiting three\n",
    ] {
        assert!(
            matches!(parse_exposition(text), Err(LoadParseError::Malformed(_))),
            "{text:?}: {:?}",
            parse_exposition(text)
        );
    }
}

#[test]
fn negative_or_infinite_load_is_an_error() {
    for (text, value) in [
        ("vllm:num_requests_waiting -1\n", "-1"),
        ("sglang:num_queue_reqs +Inf\n", "+Inf"),
        ("vllm:num_requests_running NaN\n", "NaN"),
    ] {
        match parse_exposition(text) {
            Err(LoadParseError::BadValue { value: v, .. }) => assert_eq!(v, value),
            other => panic!("{text:?}: {other:?}"),
        }
    }
}

#[test]
fn a_page_without_queue_series_is_an_error() {
    let text = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n";
    assert_eq!(parse_exposition(text), Err(LoadParseError::NoLoadSeries));
    assert_eq!(parse_exposition(""), Err(LoadParseError::NoLoadSeries));
}

#[test]
fn an_oversized_page_is_refused_before_parsing() {
    let mut text = VLLM.to_owned();
    let filler = "# TYPE filler gauge\nfiller 1\n";
    while text.len() <= MAX_EXPOSITION_BYTES {
        text.push_str(filler);
    }
    assert_eq!(
        parse_exposition(&text),
        Err(LoadParseError::TooLarge {
            limit: MAX_EXPOSITION_BYTES
        })
    );
    // The same series under the bound parse.
    text.truncate(MAX_EXPOSITION_BYTES - filler.len());
    let end = text.rfind('\n').unwrap() + 1;
    text.truncate(end);
    assert_eq!(parse_exposition(&text).unwrap().waiting, 3);
}

proptest::proptest! {
    /// Whatever a worker sends, the parser answers (no panic), and a page
    /// it accepts holds only finite, non-negative loads.
    #[test]
    fn any_text_is_answered(text in "(#|vllm:num_requests_waiting|sglang:token_usage|\\{|\\}|=|\"|[a-z_:]{1,8}| |\\n|[0-9.eE+-]{1,6}|NaN|Inf){0,40}") {
        if let Ok(load) = parse_exposition(&text) {
            proptest::prop_assert!(load.cache_usage.is_none_or(|c| (0.0..=1.0).contains(&c)));
        }
    }
}

#[test]
fn huge_counts_saturate() {
    let load = parse_exposition("vllm:num_requests_waiting 1e30\n").unwrap();
    assert_eq!(load.waiting, u32::MAX);
    assert_eq!(load.requests(), u32::MAX);
}

const INTERVAL: Duration = Duration::from_millis(500);

fn load(waiting: u32) -> ReportedLoad {
    ReportedLoad {
        waiting,
        running: 1,
        cache_usage: Some(0.5),
    }
}

#[test]
fn a_report_lasts_three_intervals_through_failed_scrapes_then_falls_back() {
    let clock = ManualClock::new();
    let cell = LoadCell::default();
    cell.configure(INTERVAL, None);
    assert_eq!(cell.current(clock.now()), None, "nothing reported yet");

    cell.record("w", ScrapeOutcome::Ok(load(4)), clock.now());
    assert_eq!(cell.current(clock.now()), Some(load(4)));
    // Three failed intervals: the last value holds.
    for outcome in [
        ScrapeOutcome::Error,
        ScrapeOutcome::Timeout,
        ScrapeOutcome::Error,
    ] {
        clock.advance(INTERVAL);
        cell.record("w", outcome, clock.now());
        assert_eq!(cell.current(clock.now()), Some(load(4)));
    }
    // Past three intervals: the gateway's count takes over.
    clock.advance(Duration::from_nanos(1));
    assert_eq!(cell.current(clock.now()), None);
    clock.advance(INTERVAL);
    cell.record("w", ScrapeOutcome::Timeout, clock.now());
    assert_eq!(cell.current(clock.now()), None);
    // One good scrape brings the report back.
    cell.record("w", ScrapeOutcome::Ok(load(1)), clock.now());
    assert_eq!(cell.current(clock.now()), Some(load(1)));

    assert_eq!(cell.scrapes(), [("ok", 2), ("error", 2), ("timeout", 2)]);
}

#[test]
fn an_unmonitored_worker_has_no_report() {
    let cell = LoadCell::default();
    cell.record("w", ScrapeOutcome::Ok(load(4)), 0);
    // Never configured: no interval, so no report is ever fresh past its instant.
    assert_eq!(cell.current(1), None);
}

#[test]
fn overload_needs_a_threshold_and_a_fresh_report_above_it() {
    let clock = ManualClock::new();
    let cell = LoadCell::default();
    cell.configure(INTERVAL, None);
    cell.record("w", ScrapeOutcome::Ok(load(100)), clock.now());
    assert!(
        !cell.is_overloaded(|| clock.now()),
        "no threshold, no overload"
    );

    cell.configure(INTERVAL, Some(8));
    assert!(cell.is_overloaded(|| clock.now()));
    cell.record("w", ScrapeOutcome::Ok(load(8)), clock.now());
    assert!(!cell.is_overloaded(|| clock.now()), "8 is not more than 8");
    cell.record("w", ScrapeOutcome::Ok(load(9)), clock.now());
    assert!(cell.is_overloaded(|| clock.now()));
    // A stale report overloads nobody.
    clock.advance(INTERVAL * FRESH_INTERVALS + Duration::from_nanos(1));
    assert!(!cell.is_overloaded(|| clock.now()));
}

mod selection {
    use std::sync::Arc;

    use super::*;
    use crate::health::HealthThresholds;
    use crate::registry::{Registry, RegistryConfig, Worker};
    use crate::selection::{Policy, Selector};
    use crate::spec::{BreakerDefaults, WorkerSpec};

    fn fleet(n: usize) -> (Arc<Registry>, Arc<ManualClock>, Vec<Arc<Worker>>) {
        let clock = Arc::new(ManualClock::new());
        let registry = Registry::new(
            RegistryConfig {
                breaker: BreakerDefaults::default(),
                health: HealthThresholds {
                    failure: 1,
                    success: 1,
                },
                hash_rings: false,
                max_open_percent: 100,
                removed_grace: crate::registry::DEFAULT_REMOVED_GRACE,
            },
            clock.clone(),
        );
        let specs: Vec<_> = (0..n)
            .map(|i| WorkerSpec::from_url(&format!("http://127.0.0.{}:8000", i + 1)))
            .collect();
        let workers = registry.add_all(&specs).unwrap();
        for w in &workers {
            w.load_cell().configure(INTERVAL, Some(4));
        }
        (registry, clock, workers)
    }

    #[test]
    fn an_overloaded_worker_is_passed_over_while_another_can_take_the_request() {
        let (registry, clock, workers) = fleet(3);
        for w in &workers[..2] {
            w.load_cell()
                .record(&w.url, ScrapeOutcome::Ok(load(5)), clock.now());
        }
        workers[2]
            .load_cell()
            .record(&workers[2].url, ScrapeOutcome::Ok(load(0)), clock.now());
        for policy in [
            Policy::RoundRobin,
            Policy::Random,
            Policy::PowerOfTwo,
            Policy::LeastLoad,
        ] {
            let selector = Selector::new(policy);
            for _ in 0..20 {
                let fleet = registry.fleet();
                let attempt = selector
                    .attempt(&fleet.workers, None, None, &[], &*clock)
                    .unwrap();
                assert!(Arc::ptr_eq(attempt.worker(), &workers[2]), "{policy:?}");
            }
        }
        let sheds: u64 = workers.iter().map(|w| w.load_cell().sheds()).sum();
        assert!(sheds > 0, "the passed-over workers count their sheds");
        assert_eq!(workers[2].load_cell().sheds(), 0);
    }

    #[test]
    fn cache_aware_passes_over_an_overloaded_holder_and_says_so() {
        use crate::selection::{CacheAwareConfig, Prompt, Reason};
        let (registry, clock, workers) = fleet(2);
        let selector = Selector::with_cache_aware(Policy::CacheAware, CacheAwareConfig::default());
        let prompt = Prompt {
            model: "",
            text: b"system: a long shared prompt that one worker comes to hold",
        };
        let fleet = registry.fleet();
        let first = selector
            .attempt_prompt(&fleet.workers, None, None, Some(prompt), &[], &*clock)
            .unwrap();
        let holder = first.worker().clone();
        drop(first);
        // The holder now reports a queue past the threshold.
        holder
            .load_cell()
            .record(&holder.url, ScrapeOutcome::Ok(load(5)), clock.now());
        let other = workers.iter().find(|w| !Arc::ptr_eq(w, &holder)).unwrap();
        let next = selector
            .attempt_prompt(&fleet.workers, None, None, Some(prompt), &[], &*clock)
            .unwrap();
        assert!(
            Arc::ptr_eq(next.worker(), other),
            "the overloaded holder kept it"
        );
        let cache = selector.cache_aware().unwrap();
        assert_eq!(cache.decisions(Reason::Overload), 1);
        assert_eq!(holder.load_cell().sheds(), 1);
    }

    #[test]
    fn a_retry_prefers_an_untried_overloaded_worker_to_the_one_it_tried() {
        let (registry, clock, workers) = fleet(2);
        workers[0]
            .load_cell()
            .record(&workers[0].url, ScrapeOutcome::Ok(load(50)), clock.now());
        let tried = [workers[1].breaker.id()];
        let fleet = registry.fleet();
        for policy in [Policy::RoundRobin, Policy::PowerOfTwo, Policy::LeastLoad] {
            let attempt = Selector::new(policy)
                .attempt(&fleet.workers, None, None, &tried, &*clock)
                .unwrap();
            assert!(Arc::ptr_eq(attempt.worker(), &workers[0]), "{policy:?}");
        }
    }

    #[test]
    fn when_every_worker_is_overloaded_they_still_serve() {
        let (registry, clock, workers) = fleet(2);
        for w in &workers {
            w.load_cell()
                .record(&w.url, ScrapeOutcome::Ok(load(50)), clock.now());
        }
        let selector = Selector::new(Policy::RoundRobin);
        let fleet = registry.fleet();
        assert!(
            selector
                .attempt(&fleet.workers, None, None, &[], &*clock)
                .is_some()
        );
        // Nobody else could take it: no shed.
        assert_eq!(
            workers.iter().map(|w| w.load_cell().sheds()).sum::<u64>(),
            0
        );
    }

    #[test]
    fn a_stale_overload_report_no_longer_sheds_and_the_load_falls_back_to_in_flight() {
        let (registry, clock, workers) = fleet(2);
        workers[0]
            .load_cell()
            .record(&workers[0].url, ScrapeOutcome::Ok(load(9)), clock.now());
        assert_eq!(workers[0].load(clock.now()), 10, "waiting + running");
        clock.advance(INTERVAL * FRESH_INTERVALS + Duration::from_millis(1));
        assert_eq!(workers[0].load(clock.now()), 0, "the gateway's count");
        let selector = Selector::new(Policy::RoundRobin);
        let fleet = registry.fleet();
        let picked: Vec<_> = (0..4)
            .map(|_| {
                selector
                    .attempt(&fleet.workers, None, None, &[], &*clock)
                    .unwrap()
                    .worker()
                    .id
                    .clone()
            })
            .collect();
        assert!(picked.contains(&workers[0].id), "{picked:?}");
    }

    #[test]
    fn the_load_never_reads_below_the_requests_in_flight() {
        let (_registry, clock, workers) = fleet(1);
        let w = &workers[0];
        let held: Vec<_> = (0..3).map(|_| w.try_attempt(&*clock).unwrap()).collect();
        w.load_cell()
            .record(&w.url, ScrapeOutcome::Ok(load(0)), clock.now());
        assert_eq!(w.load(clock.now()), 3);
        drop(held);
        assert_eq!(w.load(clock.now()), 1, "the report's running request");
    }
}
