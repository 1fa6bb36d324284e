//! What `inference-node addresses` computes and prints: the row ids of every
//! position of a sequence, for both Engram layers, from compressed ids or
//! from raw token ids through a token map.
//!
//! JSON shape (one object per position, in input order; row ids include the
//! layer's column offsets; a DEAD position has `"rows": null`):
//! `{"layers":[1,14],"positions":[{"id":5,"rows":{"1":[24 ids],"14":[24 ids]}}]}`

use std::fmt::Write as _;

use engram_protocol::hashing::{
    COLUMNS, DEAD, ENGRAM_LAYERS, HashError, HashParams, PositionRows, SequenceHasher,
};
use thiserror::Error;

use super::TokenMap;

/// Most positions one call takes.
pub const MAX_POSITIONS: usize = 1_000_000;

/// Why the input cannot be hashed.
#[derive(Debug, Error)]
pub enum AddressError {
    /// The id list is malformed.
    #[error("{0}")]
    List(String),
    /// A position's id is not accepted.
    #[error("position {position}: {error}")]
    Id {
        /// Index of the position in the input.
        position: usize,
        /// Why its id is not accepted.
        error: HashError,
    },
    /// A raw id has no entry in the token map.
    #[error("position {position}: raw token id {raw} is not in the token map ({len} ids)")]
    Raw {
        /// Index of the position in the input.
        position: usize,
        /// The raw token id.
        raw: i64,
        /// Raw ids the token map holds.
        len: usize,
    },
    /// The pad id is not accepted.
    #[error("pad: {0}")]
    Pad(HashError),
}

/// Parse a comma-separated list of ids (`-1` is DEAD), at most [`MAX_POSITIONS`].
pub fn parse_ids(list: &str) -> Result<Vec<i64>, AddressError> {
    let list = list.trim();
    if list.is_empty() {
        return Err(AddressError::List("the id list is empty".into()));
    }
    let mut out = Vec::new();
    for (i, item) in list.split(',').enumerate() {
        if out.len() == MAX_POSITIONS {
            return Err(AddressError::List(format!(
                "more than {MAX_POSITIONS} positions"
            )));
        }
        let item = item.trim();
        let id = item.parse::<i64>().map_err(|_| {
            AddressError::List(format!("position {i}: {item:?} is not an integer id"))
        })?;
        out.push(id);
    }
    Ok(out)
}

/// Raw token ids -> compressed ids (DEAD stays DEAD).
pub fn compress(map: &TokenMap, raw: &[i64]) -> Result<Vec<i64>, AddressError> {
    raw.iter()
        .enumerate()
        .map(|(position, &r)| {
            if r == i64::from(DEAD) {
                return Ok(r);
            }
            u32::try_from(r)
                .ok()
                .and_then(|r| map.get(r))
                .map(i64::from)
                .ok_or(AddressError::Raw {
                    position,
                    raw: r,
                    len: map.raw_len(),
                })
        })
        .collect()
}

/// Every position's rows (`None` for DEAD), checking each id.
pub fn addresses(
    params: &HashParams,
    pad: i64,
    ids: &[i64],
) -> Result<Vec<Option<PositionRows>>, AddressError> {
    let mut h = SequenceHasher::new(params, pad).map_err(AddressError::Pad)?;
    ids.iter()
        .enumerate()
        .map(|(position, &id)| {
            let mut rows = [[0u64; COLUMNS]; 2];
            h.push(id, &mut rows)
                .map(|live| live.then_some(rows))
                .map_err(|error| AddressError::Id { position, error })
        })
        .collect()
}

/// The pinned JSON shape.
pub fn to_json(ids: &[i64], rows: &[Option<PositionRows>]) -> serde_json::Value {
    let positions: Vec<serde_json::Value> = ids
        .iter()
        .zip(rows)
        .map(|(id, r)| {
            let rows = match r {
                None => serde_json::Value::Null,
                Some(r) => {
                    let mut m = serde_json::Map::new();
                    for (layer, cols) in ENGRAM_LAYERS.iter().zip(r) {
                        m.insert(layer.to_string(), serde_json::json!(cols.to_vec()));
                    }
                    serde_json::Value::Object(m)
                }
            };
            serde_json::json!({"id": id, "rows": rows})
        })
        .collect();
    serde_json::json!({"layers": ENGRAM_LAYERS, "positions": positions})
}

/// A table for people: one line per position and layer.
pub fn to_table(
    params: &HashParams,
    pad: i64,
    ids: &[i64],
    rows: &[Option<PositionRows>],
) -> String {
    let mut s = String::new();
    let sizes: Vec<String> = params
        .layers
        .iter()
        .map(|l| format!("layer {}: {} rows", l.layer, l.rows))
        .collect();
    let _ = writeln!(
        s,
        "preset {} ({}), pad id {pad}",
        params.preset,
        sizes.join(", ")
    );
    let _ = writeln!(
        s,
        "{:>5} {:>6} {:>5}  row ids (orders 2, 3, 4 x 8 heads; offsets included)",
        "pos", "id", "layer"
    );
    for (p, (id, r)) in ids.iter().zip(rows).enumerate() {
        match r {
            None => {
                let _ = writeln!(s, "{p:>5} {id:>6} {:>5}  DEAD (gate 0, no rows)", "-");
            }
            Some(r) => {
                for (i, (layer, cols)) in ENGRAM_LAYERS.iter().zip(r).enumerate() {
                    let (pp, ii) = if i == 0 {
                        (p.to_string(), id.to_string())
                    } else {
                        (String::new(), String::new())
                    };
                    let list: Vec<String> = cols.iter().map(u64::to_string).collect();
                    let _ = writeln!(s, "{pp:>5} {ii:>6} {layer:>5}  {}", list.join(" "));
                }
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use engram_protocol::hashing::{Preset, hash_sequence};

    use super::*;

    #[test]
    fn json_has_the_pinned_shape() {
        let p = HashParams::v41();
        let ids = parse_ids("5, 17,-1,99091").unwrap();
        let rows = addresses(&p, 2, &ids).unwrap();
        let v = to_json(&ids, &rows);
        assert_eq!(v["layers"], serde_json::json!([1, 14]));
        let pos = v["positions"].as_array().unwrap();
        assert_eq!(pos.len(), 4);
        assert_eq!(pos[2], serde_json::json!({"id": -1, "rows": null}));
        assert_eq!(pos[3]["id"], 99091);
        let l1 = pos[0]["rows"]["1"].as_array().unwrap();
        assert_eq!(l1.len(), 24);
        assert_eq!(pos[0]["rows"]["14"].as_array().unwrap().len(), 24);
        let want = hash_sequence(&p, 2, &ids).unwrap();
        assert_eq!(l1[23].as_u64(), want[0].map(|r| r[0][23]));
        let text = v.to_string();
        assert!(text.starts_with(r#"{"layers":[1,14],"positions":[{"id":5,"rows":{"1":["#));
    }

    #[test]
    fn bad_input_names_the_position() {
        let p = HashParams::new(Preset::Base(1000)).unwrap();
        assert!(parse_ids("").is_err());
        assert!(
            parse_ids("1,,2")
                .unwrap_err()
                .to_string()
                .contains("position 1")
        );
        assert!(parse_ids("1,x").unwrap_err().to_string().contains("\"x\""));
        let e = addresses(&p, 2, &[1, 2, 99_092]).unwrap_err().to_string();
        assert!(e.contains("position 2") && e.contains("99092"), "{e}");
        let e = addresses(&p, -1, &[1]).unwrap_err().to_string();
        assert!(e.contains("pad"), "{e}");
        let map = TokenMap::from_ids(vec![0, 1, 1, 2]).unwrap();
        assert_eq!(compress(&map, &[3, -1, 2]).unwrap(), vec![2, -1, 1]);
        let e = compress(&map, &[0, 4]).unwrap_err().to_string();
        assert!(e.contains("position 1") && e.contains("4 ids"), "{e}");
        assert!(compress(&map, &[-2]).is_err());
    }

    #[test]
    fn the_table_lists_every_position() {
        let p = HashParams::new(Preset::Base(1000)).unwrap();
        let ids = [3, -1, 4];
        let rows = addresses(&p, 0, &ids).unwrap();
        let t = to_table(&p, 0, &ids, &rows);
        assert!(t.contains("DEAD"));
        assert_eq!(t.lines().count(), 2 + 2 + 1 + 2);
    }
}
