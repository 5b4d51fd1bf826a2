//! The exit-code table of the docs (docs/operations.md) is the one in `dflash_shell::Exit`: the
//! same codes, each row opening with the same word, nothing more or less.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use dflash_shell::Exit;

#[test]
fn the_readme_table_matches_the_exit_codes() {
    // The table lives in the operations guide (the README links to it).
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let readme = ["docs/operations.md", "README.md"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(format!("{root}/{path}")).ok())
        .find(|text| text.contains("| exit code |"))
        .expect("docs/operations.md (or the README) has an exit-code table");
    let table_start = readme.find("| exit code |").expect("the exit-code table");
    let rows: Vec<(u8, String)> = readme[table_start..]
        .lines()
        .skip(2) // header and separator
        .take_while(|line| line.starts_with('|'))
        .map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let code = cells[1]
                .parse()
                .unwrap_or_else(|_| panic!("row {line:?}: no code"));
            let word = cells[2].split(':').next().unwrap_or_default().to_string();
            (code, word)
        })
        .collect();
    let expected: Vec<(u8, String)> = Exit::ALL
        .iter()
        .map(|exit| (exit.code(), exit.name().to_string()))
        .collect();
    assert_eq!(rows, expected);
}
