//! The exit codes of every dflash binary (`broker`, `target-server`,
//! `drafter-server`, `dflash`): one table, one meaning per code.
//!
//! | code | meaning |
//! |---|---|
//! | 0 | done: the work is finished (target: shard produced and reported done; drafter: end-of-stream COMPLETE, or a requested stop that handed everything back; broker: served until told to stop; `dflash local`: the run is OK) |
//! | 1 | failed: an error (configuration, I/O, model, a broker that refused data or stayed unreachable) |
//! | 2 | usage: the command line is wrong (clap's own code) |
//! | 3 | aborted: the broker ended the run ABORTED (a target failed under the `abort` policy) |
//! | 4 | interrupted: stopped by a signal before the work was finished; a restart resumes (a target's unfinished shard) |

use std::process::ExitCode;

/// How a binary ends; `main` returns `ExitCode::from(exit)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Done,
    Failed,
    Usage,
    Aborted,
    Interrupted,
}

impl Exit {
    pub fn code(self) -> u8 {
        match self {
            Exit::Done => 0,
            Exit::Failed => 1,
            Exit::Usage => 2,
            Exit::Aborted => 3,
            Exit::Interrupted => 4,
        }
    }
}

impl Exit {
    /// Every exit, in code order.
    pub const ALL: [Exit; 5] = [
        Exit::Done,
        Exit::Failed,
        Exit::Usage,
        Exit::Aborted,
        Exit::Interrupted,
    ];

    /// The word that opens the code's row in the table (here and in the
    /// README).
    pub fn name(self) -> &'static str {
        match self {
            Exit::Done => "done",
            Exit::Failed => "failed",
            Exit::Usage => "usage",
            Exit::Aborted => "aborted",
            Exit::Interrupted => "interrupted",
        }
    }
}

impl From<Exit> for ExitCode {
    fn from(exit: Exit) -> ExitCode {
        ExitCode::from(exit.code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_usage_is_clap_s() {
        let mut codes: Vec<u8> = Exit::ALL.iter().map(|exit| exit.code()).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes, vec![0, 1, 2, 3, 4]);
        // clap exits 2 on a usage error; the table must agree with it.
        let error = clap::Command::new("probe")
            .try_get_matches_from(["probe", "--no-such-flag"])
            .unwrap_err();
        assert_eq!(error.exit_code(), i32::from(Exit::Usage.code()));
    }
}
