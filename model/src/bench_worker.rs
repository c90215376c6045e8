//! What the model benches share with their Python side: a diffusers subprocess that builds its
//! model from a JSON spec, prints `ready`, then times one forward per `run` line it reads
//! (milliseconds, one line each), and the summaries of timed runs.
use anyhow::{Context, Result};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// A running diffusers bench script (`python -c SCRIPT SPEC`); dropping it ends the script.
pub struct DiffusersWorker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl DiffusersWorker {
    /// Start `script` with `spec` and wait for its `ready`.
    pub fn start(python: &str, script: &str, spec: &serde_json::Value) -> Result<Self> {
        let mut child = Command::new(python)
            .args(["-c", script, &spec.to_string()])
            .current_dir(Path::new("/"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("running {python}"))?;
        let stdin = child.stdin.take().context("diffusers stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("diffusers stdout")?);
        let mut worker = Self {
            child,
            stdin,
            stdout,
        };
        anyhow::ensure!(
            worker.read_line()? == "ready",
            "diffusers bench did not start"
        );
        Ok(worker)
    }

    fn read_line(&mut self) -> Result<String> {
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        anyhow::ensure!(
            !line.is_empty(),
            "diffusers bench exited (see its stderr above)"
        );
        Ok(line.trim().to_string())
    }

    /// One timed diffusers forward, in milliseconds.
    pub fn run(&mut self) -> Result<f64> {
        writeln!(self.stdin, "run")?;
        self.stdin.flush()?;
        let line = self.read_line()?;
        line.parse()
            .with_context(|| format!("diffusers bench printed `{line}`"))
    }
}

impl Drop for DiffusersWorker {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

/// The fastest of `times` (on a shared machine, the least disturbed run).
pub fn minimum(times: &[f64]) -> f64 {
    times.iter().copied().reduce(f64::min).unwrap_or(f64::NAN)
}

/// The median of `times` (the upper one of an even count).
pub fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times.get(times.len() / 2).copied().unwrap_or(f64::NAN)
}
