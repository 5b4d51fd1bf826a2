//! all_reduce_sum over c10d's Gloo on loopback: W processes (this binary,
//! started again as workers), per tensor size the median seconds over the
//! repetitions, the algorithm bandwidth (tensor bytes / seconds) and the
//! bytes each rank sends in a ring all-reduce, 2(W-1)/W x the tensor.
//!
//! `cargo run -p dflash-collective --example allreduce_bench --
//!  [--worlds 2,4] [--sizes 16M,64M,277M] [--repetitions 3]` (`make bench-collective`).
//! Sizes are f32 element counts (K, M suffixes: 10^3, 10^6). The dev profile
//! is enough: the work is libtorch's, and dependencies are built optimised.
//! Each size needs world x size x 4 bytes of memory (4.4 GB at W 4, 277 M).
//! Timings are rank 0's, each repetition started right after a barrier.

use std::error::Error;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dflash_collective::{GroupOptions, ProcessGroup, Store};
use tch::{Kind, Tensor};

/// Set in a worker: `rank,world_size,store_port,repetitions,size;size;...`.
const WORKER_VARIABLE: &str = "DFLASH_ALLREDUCE_BENCH_WORKER";
const RESULT_TAG: &str = "allreduce-bench-result";
const TIMEOUT: Duration = Duration::from_secs(300);

type BenchResult<T> = Result<T, Box<dyn Error>>;

fn main() -> BenchResult<()> {
    if let Ok(worker) = std::env::var(WORKER_VARIABLE) {
        return run_worker(&worker);
    }
    let mut worlds = vec![2usize, 4];
    let mut sizes = vec![16_000_000usize, 64_000_000, 277_000_000];
    let mut repetitions = 3usize;
    let mut arguments = std::env::args().skip(1);
    while let Some(argument) = arguments.next() {
        let value = arguments
            .next()
            .ok_or_else(|| format!("{argument} needs a value"))?;
        match argument.as_str() {
            "--worlds" => worlds = parse_list(&value, |item| Ok(item.parse()?))?,
            "--sizes" => sizes = parse_list(&value, parse_size)?,
            "--repetitions" => repetitions = value.parse()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if repetitions == 0 || worlds.contains(&0) {
        return Err("repetitions and worlds must be positive".into());
    }

    println!(
        "c10d ProcessGroupGloo all_reduce_sum, loopback, {} cpu cores, median of {repetitions}",
        std::thread::available_parallelism().map_or(0, |cores| cores.get())
    );
    println!(
        "{:>5} {:>12} {:>10} {:>10} {:>10} {:>16}",
        "world", "f32 elements", "MB", "median s", "algo GB/s", "MB sent per rank"
    );
    for &world_size in &worlds {
        let medians = run_world(world_size, &sizes, repetitions)?;
        for (&elements, median) in sizes.iter().zip(medians) {
            let bytes = elements as f64 * 4.0;
            let sent_per_rank = 2.0 * (world_size as f64 - 1.0) / world_size as f64 * bytes;
            println!(
                "{:>5} {:>12} {:>10.1} {:>10.3} {:>10.2} {:>16.1}",
                world_size,
                elements,
                bytes / 1e6,
                median,
                bytes / median / 1e9,
                sent_per_rank / 1e6
            );
        }
    }
    Ok(())
}

fn parse_list<T>(value: &str, parse: impl Fn(&str) -> BenchResult<T>) -> BenchResult<Vec<T>> {
    value.split(',').map(|item| parse(item.trim())).collect()
}

fn parse_size(value: &str) -> BenchResult<usize> {
    let (digits, scale) = match value.chars().last() {
        Some('M' | 'm') => (&value[..value.len() - 1], 1_000_000),
        Some('K' | 'k') => (&value[..value.len() - 1], 1_000),
        _ => (value, 1),
    };
    Ok(digits.parse::<usize>()? * scale)
}

/// Hosts the store, starts `world_size` workers, returns rank 0's medians.
fn run_world(world_size: usize, sizes: &[usize], repetitions: usize) -> BenchResult<Vec<f64>> {
    let store = Store::host("127.0.0.1", 0, TIMEOUT)?;
    let sizes_field = sizes
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(";");
    let executable = std::env::current_exe()?;
    let mut workers: Vec<Child> = Vec::new();
    for rank in 0..world_size {
        let worker = Command::new(&executable)
            .env(
                WORKER_VARIABLE,
                format!(
                    "{rank},{world_size},{},{repetitions},{sizes_field}",
                    store.port()
                ),
            )
            .stdout(if rank == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .spawn()?;
        workers.push(worker);
    }
    let mut medians = Vec::new();
    if let Some(stdout) = workers
        .first_mut()
        .and_then(|rank_zero| rank_zero.stdout.take())
    {
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            if let Some(median) = line.strip_prefix(RESULT_TAG) {
                medians.push(median.trim().parse::<f64>()?);
            }
        }
    }
    for (rank, mut worker) in workers.into_iter().enumerate() {
        let status = worker.wait()?;
        if !status.success() {
            return Err(format!("worker rank {rank} of {world_size} ended with {status}").into());
        }
    }
    if medians.len() != sizes.len() {
        return Err(format!("rank 0 reported {} of {} sizes", medians.len(), sizes.len()).into());
    }
    Ok(medians)
}

fn run_worker(specification: &str) -> BenchResult<()> {
    let fields: Vec<&str> = specification.split(',').collect();
    let [rank, world_size, port, repetitions, sizes] = fields[..] else {
        return Err(format!("bad {WORKER_VARIABLE}: {specification}").into());
    };
    let rank: usize = rank.parse()?;
    let world_size: usize = world_size.parse()?;
    let repetitions: usize = repetitions.parse()?;
    let sizes = parse_list(sizes.replace(';', ",").as_str(), parse_size)?;
    let group = ProcessGroup::new(
        &GroupOptions {
            store_host: "127.0.0.1".to_string(),
            store_port: port.parse()?,
            prefix: format!("bench-w{world_size}"),
            rank,
            world_size,
            interface_host: "127.0.0.1".to_string(),
            timeout: TIMEOUT,
            ..GroupOptions::default()
        },
        None,
    )?;
    // Connections and Gloo's first-call set-up out of the timings.
    group.all_reduce_sum(&mut Tensor::ones([1024], (Kind::Float, tch::Device::Cpu)))?;
    for elements in sizes {
        let mut tensor = Tensor::ones([elements as i64], (Kind::Float, tch::Device::Cpu));
        let mut seconds = Vec::with_capacity(repetitions);
        for _ in 0..repetitions {
            group.barrier()?;
            let started = Instant::now();
            group.all_reduce_sum(&mut tensor)?;
            seconds.push(started.elapsed().as_secs_f64());
        }
        seconds.sort_by(f64::total_cmp);
        if rank == 0 {
            println!("{RESULT_TAG} {}", seconds[seconds.len() / 2]);
        }
    }
    group.barrier()?;
    Ok(())
}
